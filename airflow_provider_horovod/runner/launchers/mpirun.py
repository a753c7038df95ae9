"""``launcher="mpirun"`` (the default): mpirun without SSH, an exec service in each barrier task and an
rsh agent for ``mpirun`` (``mpirun_rsh.py``).

Partition 0 runs ``mpirun -mca plm_rsh_agent <agent>`` with one pseudo host name per executor.
For each host Open MPI calls ``<agent> <host> orted <args...>``; the agent connects to the exec
service of that host's first barrier task (authenticated with the run's secret) and asks it to
start ``orted``; the service starts it under a reaper that dies with the task. The service starts
nothing but ``orted``, from an argv list, never through a shell, and only the ``orted`` command
line this run's own mpirun produces (``check_orted``): known MCA keys with the values mpirun
was given, the HNP URI pointing at partition 0's task. It launches once, for its own host, then
stops listening. It accepts only the ``exec`` role's key, which only partition 0's rsh agent has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from airflow_provider_horovod.runner import messages, names, procs, wire
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.exits import exit_text, read_error_file, tail, who
from airflow_provider_horovod.runner.launchers import Services
from airflow_provider_horovod.runner.launchers.processes import WORKER, hand_over_key, rank_command, run_reaped
from airflow_provider_horovod.runner.messages import LaunchOrted, OrtedExited, OrtedStarted
from airflow_provider_horovod.runner.names import SESSION_DIR_PREFIX, TaskDir, new_temp_dir
from airflow_provider_horovod.runner.plan import Plan
from airflow_provider_horovod.runner.horovod_stall import stall_env

OPEN_MPI_PROGRAMS = MPIRUN, ORTED = ("mpirun", "orted")  # what mpirun needs on every host's PATH


def orted_argv(words: list[str]) -> list[str]:
    """The ``orted`` command in what Open MPI handed the agent.

    Open MPI quotes some arguments for a remote shell (``-mca orte_hnp_uri "..."``) and may prefix
    ``VAR=value ; export VAR ;`` assignments; the words are split as a POSIX shell would split
    them, without running one, and everything before ``orted`` is dropped.
    """
    tokens = shlex.split(" ".join(words))
    for i, token in enumerate(tokens):
        if os.path.basename(token) == ORTED:
            return [ORTED, *tokens[i + 1 :]]
    raise ValueError("the rsh agent was asked to run something other than orted: %r" % (words[:3],))


HNP_PORT_OPTION = "oob_tcp_dynamic_ipv4_ports"  # mpirun passes it on to every orted; the service takes it off


def without_hnp_port(argv: list[str]) -> list[str]:
    """``orted``'s argv without the HNP's port option: each daemon picks its own port (two on one
    machine would clash on mpirun's)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("-mca", "--mca") and argv[i + 1 : i + 2] == [HNP_PORT_OPTION]:
            i += 3
            continue
        out.append(argv[i])
        i += 1
    return out


class OrtedRefused(ValueError):
    """An ``orted`` command line this run's mpirun would not have produced."""


_DIGITS = re.compile(r"^\d+$")
_NODE_REGEX = re.compile(r"^[A-Za-z0-9_.,:@\[\]()\-]+$")
_COMPONENTS = re.compile(r"^\^?[A-Za-z0-9_,]+$")
_URI = re.compile(r"^\d+\.\d+;(?P<uris>.+)$")
_TCP = re.compile(r"^tcp6?://(?P<addrs>[^/]+):(?P<ports>\d+(?:,\d+)*)$")  # mpirun lists every port it holds


def _hnp_addresses(value: str) -> list[tuple[list[str], list[int]]] | None:
    """The addresses and ports of each URI in an HNP URI (``jobid.vpid;tcp://a,b:p1,p2;tcp6://[c]:p``),
    or None if malformed (an mpirun that could bind none of its ports writes ``tcp://a:``)."""
    found = _URI.match(value)
    if not found:
        return None
    uris = []
    for uri in found.group("uris").split(";"):
        tcp = _TCP.match(uri)
        if not tcp:
            return None
        try:
            uris.append(([str(ipaddress.ip_address(addr.strip("[]"))) for addr in tcp.group("addrs").split(",")],
                         [int(port) for port in tcp.group("ports").split(",")]))
        except ValueError:
            return None
    return uris


def check_orted(argv: list[str], plan: Plan, env: dict[str, str], vpid: int | None = None, *,
                agent: str | None = None) -> None:
    """Refuse (``OrtedRefused``) any ``orted`` command line but the one this run's mpirun produces.

    The options mpirun itself was given (``mpirun_argv``) must come back with the same values; the
    ones Open MPI adds are checked by shape; the HNP URI must be exactly mpirun's (one URI: partition
    0's address and ports it held for mpirun), and the daemon's number (``vpid``) the one of the host asked for (its
    place in the plan, from 1); ``OMPI_MCA_*`` settings of the run's environment pass as they are.
    Anything else (``orte_fork_agent``, ``orte_launch_agent``, a foreign HNP ...) is refused.
    """
    root = plan.slots[0]
    ours = mpirun_argv(plan, agent=agent, networks=plan.networks)
    exact = {ours[i + 1]: ours[i + 2] for i, word in enumerate(ours) if word == "-mca"}
    exact.update({k[len("OMPI_MCA_"):]: v for k, v in env.items() if k.startswith("OMPI_MCA_")})
    exact.pop("orte_tmpdir_base", None)  # the exec service's own, per orted
    exact.update({"orte_leave_session_attached": "1", "ess": "env", "plm": "rsh",
                  "hwloc_base_binding_policy": "none", "rmaps_base_mapping_policy": "slot",
                  "ess_base_num_procs": str(len(plan.hosts) + 1)})
    root_address = str(ipaddress.ip_address(root.address)) if root.address else ""

    def shaped(key: str, value: str) -> bool:
        if key == "ess_base_jobid":
            return bool(_DIGITS.match(value))
        if key == "ess_base_vpid":
            return bool(_DIGITS.match(value)) and 1 <= int(value) <= len(plan.hosts) and vpid in (None, int(value))
        if key == "orte_node_regex":
            return bool(_NODE_REGEX.match(value))
        if key == "pmix":
            return bool(_COMPONENTS.match(value))
        if key == "orte_hnp_uri":
            # exactly the one URI mpirun listens on: partition 0's address and ports it held for
            # mpirun (oob_tcp_if_include keeps mpirun to the plan's IPv4 networks: no other URI)
            uris = _hnp_addresses(value) or []
            return (len(uris) == 1 and uris[0][0] == [root_address]
                    and set(uris[0][1]) <= set(root.hnp_ports or uris[0][1]))
        raise OrtedRefused("orted option -mca %s is not one this run's mpirun passes" % key)

    if argv[:1] != [ORTED]:
        raise OrtedRefused("not an orted command")
    words = argv[1:]
    i = 0
    while i < len(words):
        if words[i] not in ("-mca", "--mca") or i + 2 >= len(words):
            raise OrtedRefused("orted argument %r is not one this run's mpirun passes" % words[i][:80])
        key, value = words[i + 1], words[i + 2]
        ok = exact[key] == value if key in exact else shaped(key, value)
        if not ok:
            raise OrtedRefused("orted option -mca %s %r is not what this run's mpirun passes" % (key, value[:200]))
        i += 3


class ExecService:
    """Starts ``orted`` for authenticated requests; kills it when the requester goes away.

    Until ``expect`` gives it the plan it starts nothing; then, if its task is the first of a host
    that mpirun reaches through the agent, it starts that host's one ``orted``; otherwise it closes.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        env: dict[str, str],
        watch_pid: int,
        on_launch: Callable[[list[str]], None] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self._keys = wire.server_keys(secret, wire.ROLE_EXEC)
        self._plan: Plan | None = None
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
        self._refusals = wire.RefusalLog(lambda text: self._note("refused a connection: %s" % text))
        wire.serve(self._listener, self._keys, self._serve, "hvdrunner-exec-service", max_connections=8,
                   max_unproven=64, on_reject=self._rejected)

    def expect(self, plan: Plan, partition: int) -> None:
        """The plan is known: serve the one launch of this task's host, or close if there is none.

        mpirun starts an ``orted`` on every host of the plan through the agent, its own included
        (host names are pseudo names to it), each at the host's first task."""
        self._plan = plan
        hostname = plan.for_partition(partition).hostname
        self._vpid = 1 + [name for name, _ in plan.hosts].index(hostname)
        if plan.host_leader(hostname).partition != partition:
            self._stop_listening()  # mpirun never asks this task for an orted

    def _stop_listening(self) -> None:
        wire.stop_listening(self._listener)

    def _rejected(self, err: BaseException) -> None:
        with self._lock:
            self.refused += 1
        self._refusals.note(err)

    def _serve(self, conn: wire.ServerConnection) -> None:
        proc = None
        try:
            conn.sock.settimeout(30)
            raw = conn.recv()
            conn.sock.settimeout(None)
            try:
                words = LaunchOrted.from_json(raw).words
            except wire.ProtocolError as err:
                raise OrtedRefused(str(err)) from err
            argv = orted_argv(words)  # raises ValueError for anything but orted
            with self._lock:
                if self._closed:
                    self._note("asked to start orted after the task ended")
                    return
                if self._plan is None:
                    raise OrtedRefused("asked to start orted before the task had the plan")
                if self.launches:
                    raise OrtedRefused("asked to start a second orted (one per host)")
                check_orted(argv, self._plan, self._env, self._vpid)
                argv = without_hnp_port(argv)
                # orted's own output goes to a file next to the task, never to a pipe nobody may read
                with open(self._log_path, "ab") as log_file:
                    proc = procs.spawn(procs.reaped(argv, self._watch_pid), self._env, stdout=log_file,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                self._procs.append(proc)
                self.launches += 1
            self._stop_listening()  # one orted per host: nothing more to serve
            if self._on_launch is not None:
                self._on_launch(argv)
            conn.send(OrtedStarted(proc.pid).to_json())
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
                conn.send(OrtedExited(proc.returncode).to_json())
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
        self._stop_listening()
        for proc in running:
            if proc.poll() is None:
                procs.kill_tree(proc)
        shutil.rmtree(self._session_dir, ignore_errors=True)


def agent_command() -> str:
    """What ``-mca plm_rsh_agent`` runs: this Python with ``mpirun_rsh.py`` (it imports almost nothing).

    Open MPI hands the agent to every ``orted`` too, and each ``orted`` refuses to start when the
    agent's program is not found on *its* host, so it must be a path every host has: the Python
    that Spark runs on every executor, never a file in one task's folder.
    """
    if " " in sys.executable:
        raise ValueError("mpirun needs a Python path without spaces on the executors (Open MPI splits "
                         "plm_rsh_agent on spaces); got %r. Use launcher='gloo' or another path." % sys.executable)
    return "%s -m airflow_provider_horovod.runner.launchers.mpirun_rsh" % sys.executable


def mpirun_argv(plan: Plan | None, *, agent: str | None = None, networks: list[str], np: int = 0,
                command: list[str] = WORKER) -> list[str]:
    """The ``mpirun`` command for ``plan`` (or for ``np`` local processes when ``plan`` is None).

    Open MPI's TCP traffic (``btl_tcp``: the ranks' messages; ``oob_tcp``: mpirun <-> orted) is
    kept to ``networks`` (CIDR), which every host matches with whatever its interface is called.
    """
    argv = [MPIRUN]
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
    if plan is not None and plan.slots[0].hnp_ports:  # the ports the orteds' HNP must be at (check_orted)
        argv += ["-mca", HNP_PORT_OPTION, ",".join(map(str, plan.slots[0].hnp_ports))]
    return argv + command



# -- the launcher's interface (``launchers``) -------------------------------------------------------
HNP_PORTS = 3  # ports held for mpirun's out-of-band channel; it listens on each one still free


class MpirunServices(Services):
    """Every task's exec service; partition 0 also holds the ports mpirun's out-of-band channel will
    listen on (bound, so no other process takes them, until mpirun is about to start).

    mpirun cannot be handed a bound socket, and Open MPI's listener sets no ``SO_REUSEADDR`` on
    such ports, so the hold ends just before mpirun binds: a connection or ``bind`` elsewhere on the
    host may take a released port in that moment (seen under load: mpirun then named no port and
    every orted was refused). mpirun listens on each held port it can still bind and names those,
    so one taken port costs nothing. The holds bind the wildcard address as mpirun does: a port in
    use on any address of the host is never held.
    """

    def __init__(self, spec, partition: int, executor: str, address: str, task: TaskDir, env: dict[str, str],
                 client) -> None:
        self._hnp_holds: list[socket.socket] = []
        if partition == 0:
            for _ in range(HNP_PORTS):
                hold = socket.socket()
                hold.bind(("", 0))
                self._hnp_holds.append(hold)

        def on_launch(_argv: list[str]) -> None:
            client.send(messages.Event("orted-launched", partition=partition, executor=executor))

        self.exec_service = ExecService(address, spec.secret, env, os.getpid(), on_launch, log_path=task.orted_log)

    def ports(self) -> dict[str, int | tuple[int, ...]]:
        return {"service_port": self.exec_service.port,
                "hnp_ports": tuple(hold.getsockname()[1] for hold in self._hnp_holds)}

    def expect(self, plan: Plan, partition: int) -> None:
        self.exec_service.expect(plan, partition)

    def release_hnp_ports(self) -> None:
        """Just before mpirun starts: let it take the ports the plan pins (``check_orted``)."""
        for hold in self._hnp_holds:
            hold.close()

    def close(self) -> None:
        self.release_hnp_ports()
        self.exec_service.close()


def serve(spec, partition: int, executor: str, address: str, task: TaskDir, env: dict[str, str],
          client) -> MpirunServices:
    return MpirunServices(spec, partition, executor, address, task, env, client)


def host_env(spec) -> dict[str, str]:
    """As under ``horovodrun --mpi``: MPI says who is which rank (no ``HOROVOD_RANK`` & co, which
    Horovod code reads as "launched with Gloo"); Horovod's stall check from ``stall_timeout``."""
    return {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi", **stall_env(spec.stall_timeout_s)}


def warm_env(spec, env: dict[str, str], local_size: int) -> dict[str, str]:
    return {}


def missing_programs(path: str) -> tuple[str, ...]:
    return tuple(p for p in OPEN_MPI_PROGRAMS if shutil.which(p, path=path) is None)


def start(spec, plan: Plan, partition: int, task: TaskDir, env: dict[str, str], services: MpirunServices,
          client) -> Failure | None:
    """Partition 0 runs mpirun for every host; the first task of every other host waits for its orted."""
    if partition != 0:
        return wait_for_orted(plan, partition, task, services, client)
    leaders = {name: plan.host_leader(name) for name, _ in plan.hosts}
    env = dict(env)
    env[names.ENV_EXEC_SERVICES] = json.dumps({name: "%s:%d" % (s.address, s.service_port) for name, s in leaders.items()})
    hand_over_key(task.exec_key, wire.role_key(spec.secret, wire.ROLE_EXEC))
    services.release_hnp_ports()
    try:
        return run_mpirun(plan, mpirun_argv(plan, networks=plan.networks, command=rank_command(env)), env, task)
    finally:
        with contextlib.suppress(OSError):
            task.exec_key.unlink()


def start_local(spec, plan: Plan, task: TaskDir, env: dict[str, str]) -> Failure | None:
    return run_mpirun(plan, mpirun_argv(None, np=plan.size, networks=plan.networks, command=rank_command(env)), env, task)


def wait_for_orted(plan: Plan, partition: int, task: TaskDir, services: MpirunServices, client) -> Failure | None:
    """The first task of every other host: wait until its ``orted`` ended (or the driver says
    stop), so its report can say how that host's daemon ended."""
    slot = plan.for_partition(partition)
    if not client.connected or plan.host_leader(slot.hostname).partition != partition:
        return None
    service = services.exec_service
    while not service.orted_ended.wait(0.2):
        if client.stopped.is_set():
            break
    if not service.orted_code:
        return None
    how = exit_text(service.orted_code)
    return Failure("orted on host %s (executor %s) %s" % (slot.hostname, slot.executor, how), host=slot.hostname,
                   executor=slot.executor, exit=how, launcher_output=tuple(["-- orted on host %s:" % slot.hostname]
                                                                          + tail(task.orted_log, 30)),
                   consequence=True)


def run_mpirun(plan: Plan, argv: list[str], env: dict[str, str], task: TaskDir) -> Failure | None:
    """Run ``mpirun`` under a reaper (it dies with this task) to its end; why it failed, if it did."""
    code, pid = run_reaped(argv, env, task.mpirun_log)
    return mpirun_failure(plan, code, task, stopping=procs.killed_by_us(pid)) if code != 0 else None


_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_PROCESS_NAME = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
_ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+\s+with errorcode (-?\d+)")


def parse_mpirun_exit(lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code; negative: signal) of the first rank mpirun reports as failed, if it says."""
    text = "\n".join(lines)
    found = _SIGNALLED.search(text)
    if found:
        return int(found.group(1)), -int(found.group(2))
    name, code = _PROCESS_NAME.search(text), _EXIT_CODE.search(text)
    if name and code:
        return int(name.group(1)), int(code.group(1))
    aborted = _ABORTED.search(" ".join(lines))
    if aborted:
        return int(aborted.group(1)), int(aborted.group(2))
    return None


def shell_status(code: int) -> int:
    """mpirun's exit code as a process status: like a shell, it exits with 128 + N when signal N
    ended the job (-N here); any other code is its own (255: mpirun itself failed)."""
    return 128 - code if 128 < code < 128 + signal.NSIG else code


def mpirun_failure(plan: Plan, code: int, task: TaskDir, *, stopping: bool) -> Failure:
    """Why mpirun failed: the failing rank (its own report when it made one), then mpirun's words."""
    said = tail(task.mpirun_log)
    orted = tail(task.orted_log, 30)
    agent = tail(task.rsh_log, 30)
    launcher_output = tuple(said + (["-- orted on this host:"] + orted if orted else [])
                            + (["-- the rsh agent:"] + agent if agent else []))
    reports = [f for f in (read_error_file(s) for s in plan.slots) if f is not None]
    if reports:
        first = min(reports, key=lambda f: f.time)
        return dataclasses.replace(first, launcher_output=launcher_output, consequence=stopping)
    exited = parse_mpirun_exit(said)
    slot = plan.slots[exited[0]] if exited is not None and exited[0] < plan.size else None
    if slot is not None:
        how = exit_text(exited[1])
        own_log = TaskDir(slot.task_dir).rank_log(slot.rank)
        return Failure(message="%s %s" % (who(slot), how), rank=slot.rank, host=slot.hostname,
                       executor=slot.executor, exit=how, tail=tuple(tail(own_log)),
                       launcher_output=launcher_output, consequence=stopping)
    return Failure(message="mpirun %s before any rank reported why" % exit_text(shell_status(code)),
                   exit=exit_text(code), launcher_output=launcher_output, consequence=stopping)
