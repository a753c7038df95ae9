"""``python -m airflow_provider_horovod.runner.launchers.mpirun_rsh <host> orted <args...>``: mpirun's rsh agent, without SSH.

Open MPI calls it once per host (``-mca plm_rsh_agent``); it asks the exec service in that host's
barrier task (authenticated with the run's secret) to start ``orted``, and holds the connection
open while ``orted`` runs, as ssh would. It imports only ``wire``: it starts once per host per run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.messages import LaunchOrted, OrtedExited
from airflow_provider_horovod.runner.names import AGENT_LOG, ENV_EXEC_SERVICES, ENV_PLAN, EXEC_KEY


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
    except BaseException as err:  # noqa: BLE001 - mpirun sends our stderr to /dev/null: say it in the log
        _note("hvdrunner-rsh %s: %s: %s" % (argv[:1], type(err).__name__, err))
        code = 255
    if code != 0:
        _note("hvdrunner-rsh %s: orted ended with %d" % (argv[:1], code))
    sys.exit(code)


def _note(line: str) -> None:
    """Open MPI discards the agent's output; its words go into the task folder of the mpirun that called it."""
    plan = os.environ.get(ENV_PLAN)
    if not plan:
        return
    with contextlib.suppress(OSError), open(os.path.join(os.path.dirname(plan), AGENT_LOG), "a") as f:
        f.write(line + "\n")


def _run(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: hvdrunner-rsh HOST COMMAND...\n")
        return 2
    host, words = argv[0], argv[1:]
    services = json.loads(os.environ[ENV_EXEC_SERVICES])
    if host not in services:
        _note("hvdrunner-rsh: no exec service for host %r (known: %s)" % (host, sorted(services)))
        return 255
    addr, _, port = services[host].rpartition(":")
    # the key is in a private file in mpirun's task folder (never in mpirun's or this process's environ)
    with open(os.path.join(os.path.dirname(os.environ[ENV_PLAN]), EXEC_KEY)) as f:
        key = bytes.fromhex(f.read())
    conn = wire.connect((addr, int(port)), wire.Credentials(wire.ROLE_EXEC, key), timeout=30)
    signal.signal(signal.SIGTERM, lambda *_: (conn.close(), os._exit(143)))
    conn.send(LaunchOrted(words).to_json())
    code = 255
    with contextlib.suppress(ConnectionError, OSError, ValueError):
        conn.recv()  # OrtedStarted
        code = OrtedExited.from_json(conn.recv()).code
    conn.close()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    main()
