"""mpirun without SSH: an exec service in each barrier task and an rsh agent for ``mpirun``.

Partition 0 runs ``mpirun -mca plm_rsh_agent <agent>`` with one pseudo host name per executor.
For each host Open MPI calls ``<agent> <host> orted <args...>``; the agent connects to the exec
service of that host's first barrier task (authenticated with the run's secret) and asks it to
start ``orted``; the service starts it under a reaper that dies with the task. The service starts
nothing but ``orted``, from an argv list, never through a shell.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from airflow_provider_horovod.runner import procs, wire
from airflow_provider_horovod.runner.host import WORKER
from airflow_provider_horovod.runner.names import SESSION_DIR_PREFIX, new_temp_dir
from airflow_provider_horovod.runner.plan import Plan


def orted_argv(words: list[str]) -> list[str]:
    """The ``orted`` command in what Open MPI handed the agent.

    Open MPI quotes some arguments for a remote shell (``-mca orte_hnp_uri "..."``) and may prefix
    ``VAR=value ; export VAR ;`` assignments; the words are split as a POSIX shell would split
    them, without running one, and everything before ``orted`` is dropped.
    """
    tokens = shlex.split(" ".join(words))
    for i, token in enumerate(tokens):
        if os.path.basename(token) == "orted":
            return ["orted", *tokens[i + 1 :]]
    raise ValueError("the rsh agent was asked to run something other than orted: %r" % (words[:3],))


class ExecService:
    """Starts ``orted`` for authenticated requests; kills it when the requester goes away."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        env: dict[str, str],
        watch_pid: int,
        on_launch: Callable[[list[str]], None] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self._secret = secret
        self._log_path = log_path or Path(os.devnull)
        # Every orted gets a session directory of its own. By default all daemons of a job on one
        # machine share /tmp/ompi.<host>.<uid>/jf.<jobfam>/, and Open MPI 4.1 does not expect two
        # of them there (two executors on one machine are two hosts to the runner): they race on
        # mkdir ("File exists"), on PMIx's shared store and on the shared hwloc topology (orted
        # SIGSEGV in hwloc_shmem_topology_write), and mpirun says "ORTE was unable to reliably
        # start one or more daemons" (1 launch in 10 under load here; none with this).
        self._session_dir = new_temp_dir(SESSION_DIR_PREFIX % watch_pid)
        self._env = {**env, "OMPI_MCA_orte_tmpdir_base": str(self._session_dir)}
        self._watch_pid = watch_pid
        self._on_launch = on_launch
        self._listener = wire.listen(host)
        self.port: int = self._listener.getsockname()[1]
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self.launches = 0
        self.orted_ended = threading.Event()
        self.orted_code: int | None = None
        self.refused = 0
        wire.serve(self._listener, self._secret, self._serve, "hvdrunner-exec-service")

    def _serve(self, conn: wire.ServerConnection) -> None:
        proc = None
        try:
            conn.sock.settimeout(30)
            request = conn.recv()
            conn.sock.settimeout(None)
            argv = orted_argv([str(w) for w in request["words"]])  # raises ValueError for anything but orted
            with self._lock:
                if self._closed:
                    self._note("asked to start orted after the task ended")
                    return
                # orted's own output goes to a file next to the task, never to a pipe nobody may read
                with open(self._log_path, "ab") as log_file:
                    proc = procs.spawn(procs.reaped(argv, self._watch_pid), self._env, stdout=log_file,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                self._procs.append(proc)
                self.launches += 1
            if self._on_launch is not None:
                self._on_launch(argv)
            conn.send({"started": proc.pid})
            # The agent holds the connection open while orted runs, as ssh would; if it goes away
            # (mpirun was killed), orted goes too.
            gone = threading.Event()

            def watch_peer() -> None:
                with contextlib.suppress(Exception):
                    conn.recv()
                gone.set()

            threading.Thread(target=watch_peer, daemon=True).start()
            while proc.poll() is None and not gone.wait(0.2):
                pass
            if proc.poll() is None:
                procs.kill_tree(proc)
            self.orted_code = proc.returncode
            self.orted_ended.set()
            if proc.returncode:
                self._note("orted ended with %s" % proc.returncode)
            with contextlib.suppress(OSError):
                conn.send({"exit": proc.returncode})
        except (wire.AuthenticationError, ValueError, KeyError, TypeError) as err:
            with self._lock:
                self.refused += 1
            self._note("refused a request: %s: %s" % (type(err).__name__, err))
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()

    def _note(self, line: str) -> None:
        with contextlib.suppress(OSError), open(self._log_path, "a") as f:
            f.write("hvdrunner exec service: %s\n" % line)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._procs)
        with contextlib.suppress(OSError):
            self._listener.close()
        for proc in running:
            if proc.poll() is None:
                procs.kill_tree(proc)
        shutil.rmtree(self._session_dir, ignore_errors=True)


def agent_command() -> str:
    """What ``-mca plm_rsh_agent`` runs: this Python with ``rsh.py`` (it imports almost nothing).

    Open MPI hands the agent to every ``orted`` too, and each ``orted`` refuses to start when the
    agent's program is not found on *its* host, so it must be a path every host has: the Python
    that Spark runs on every executor, never a file in one task's folder.
    """
    if " " in sys.executable:
        raise ValueError("mpirun needs a Python path without spaces on the executors (Open MPI splits "
                         "plm_rsh_agent on spaces); got %r. Use launcher='gloo' or another path." % sys.executable)
    return "%s -m airflow_provider_horovod.runner.rsh" % sys.executable


def mpirun_argv(plan: Plan | None, *, agent: str | None = None, networks: list[str], np: int = 0) -> list[str]:
    """The ``mpirun`` command for ``plan`` (or for ``np`` local processes when ``plan`` is None).

    Open MPI's TCP traffic (``btl_tcp``: the ranks' messages; ``oob_tcp``: mpirun <-> orted) is
    kept to ``networks`` (CIDR), which every host matches with whatever its interface is called.
    """
    argv = ["mpirun"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    if plan is None:
        argv += ["-np", str(np), "-H", "localhost:%d" % np]
    else:
        hosts = ",".join("%s:%d" % (name, len(slots)) for name, slots in plan.hosts)
        argv += ["-np", str(plan.size), "-H", hosts]
        argv += ["-mca", "plm_rsh_agent", agent or agent_command(), "-mca", "plm_rsh_no_tree_spawn", "1"]
    argv += ["--leave-session-attached", "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "self,tcp,vader"]
    if networks:
        include = ",".join(networks)
        argv += ["-mca", "btl_tcp_if_include", include, "-mca", "oob_tcp_if_include", include]
    return argv + WORKER


def interface_for(address: str) -> str:
    """The network interface that holds ``address`` (``lo`` for loopback)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address:
                return name
    return ""


def network_for(address: str) -> str:
    """The network of the interface that holds ``address``, in CIDR notation (``127.0.0.0/8`` for
    loopback); empty when no interface holds it."""
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address and a.netmask:
                return str(ipaddress.ip_interface("%s/%s" % (address, a.netmask)).network)
    return ""
