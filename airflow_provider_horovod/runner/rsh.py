"""``hvdrunner-rsh <host> orted <args...>``: mpirun's rsh agent, without SSH.

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
from airflow_provider_horovod.runner.names import ENV_EXEC_SERVICES, ENV_SECRET


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        sys.stderr.write("usage: hvdrunner-rsh HOST COMMAND...\n")
        sys.exit(2)
    host, words = argv[0], argv[1:]
    services = json.loads(os.environ[ENV_EXEC_SERVICES])
    if host not in services:
        sys.stderr.write("hvdrunner-rsh: no exec service for host %r (known: %s)\n" % (host, sorted(services)))
        sys.exit(255)
    addr, _, port = services[host].rpartition(":")
    secret = bytes.fromhex(os.environ[ENV_SECRET])
    conn = wire.connect((addr, int(port)), secret, timeout=30)
    signal.signal(signal.SIGTERM, lambda *_: (conn.close(), os._exit(143)))
    conn.send({"words": words})
    code = 255
    with contextlib.suppress(ConnectionError, OSError, ValueError):
        conn.recv()  # {"started": pid}
        code = int(conn.recv().get("exit", 255))
    conn.close()
    sys.exit(code if code >= 0 else 128 - code)
