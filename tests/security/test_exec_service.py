"""The exec service starts the one ``orted`` this run's mpirun asks for, and nothing else, for
nobody but the holder of the exec role's key. Finding 2 of issue #10, through real sockets and a
real ``mpirun``."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.launchers.processes import WORKER
from airflow_provider_horovod.runner.launchers.mpirun import ExecService, OrtedRefused, agent_command, check_orted, mpirun_argv, orted_argv
from airflow_provider_horovod.runner.plan import Plan
from tests.plans import loopback_plan
from tests.security.attacker import EXEC, RANK, SECRET, TASK, hung_up, settle


# The run's environment reaches both mpirun and the exec services; its OMPI_MCA_* settings pass.
_MPIRUN_ENV = {**os.environ, "OMPI_MCA_btl_base_warn_component_unused": "0"}


def _plan(tmp_path: Path, hosts: int = 2, per_host: int = 1) -> Plan:
    tasks = [tmp_path / ("task-%d" % p) for p in range(hosts * per_host)]
    for task in tasks:
        task.mkdir()
    return loopback_plan(tasks, per_host)


@pytest.fixture(scope="module")
def orted_words(tmp_path_factory) -> tuple[Plan, list[str]]:
    """The words a real mpirun hands its rsh agent for this runner's own mpirun command line (a
    recording agent stands in for the runner's, whose command then takes its place in the words)."""
    plan = _plan(tmp_path_factory.mktemp("mpirun"))
    agent = tmp_path_factory.mktemp("agent") / "record-agent"
    # It fails every launch, but only once both hosts' words are recorded (at most 10 s): mpirun
    # gives up at the first failed daemon, which must not come before it has asked for the second.
    agent.write_text(
        "#!/bin/sh\nfor w in \"$@\"; do printf '%%s\\n' \"$w\"; done > %(d)s/words-$1\n"
        "for i in $(seq 100); do [ -e %(d)s/words-hvdhost0 ] && [ -e %(d)s/words-hvdhost1 ] && break; sleep 0.1; done\n"
        "exit 1\n" % {"d": agent.parent})
    agent.chmod(0o700)
    argv = mpirun_argv(plan, agent=str(agent), networks=plan.networks)[: -len(WORKER)] + ["true"]
    subprocess.run(argv, capture_output=True, timeout=60, env=_MPIRUN_ENV)
    words = (agent.parent / "words-hvdhost1").read_text().splitlines()  # the second host's orted
    assert words[0] == "hvdhost1"
    return plan, [w.replace(str(agent), agent_command()) for w in words[1:]]


@pytest.fixture
def service(orted_words):
    plan, _ = orted_words
    launched = []
    svc = ExecService("127.0.0.1", SECRET, _MPIRUN_ENV, os.getpid(), on_launch=launched.append)
    svc.launched = launched
    yield svc
    svc.close()


def _ask(svc: ExecService, words: list[str], credentials=EXEC) -> dict | None:
    conn = wire.connect(("127.0.0.1", svc.port), credentials, timeout=5)
    conn.send({"words": words})
    conn.sock.settimeout(10)
    try:
        return conn.recv()
    except ConnectionError:
        return None
    finally:
        conn.close()


def test_the_orted_line_of_this_runs_mpirun_passes(orted_words):
    plan, words = orted_words
    check_orted(orted_argv(words), plan, _MPIRUN_ENV)


@pytest.mark.parametrize(
    "tamper",
    [
        ("add", ["-mca", "orte_fork_agent", "/bin/sh"]),  # the review's: any program started for every rank
        ("add", ["-mca", "orte_launch_agent", "/tmp/evil"]),
        ("add", ["--debug-daemons"]),
        ("set", "orte_hnp_uri", "123.0;tcp://10.9.9.9:4000"),  # a foreign HNP that would hand out work
        ("set", "orte_hnp_uri", "123.0;tcp://127.0.0.1,10.9.9.9:4000"),
        ("set", "plm_rsh_agent", "/tmp/evil-agent"),
        ("set", "btl_tcp_if_include", "eth9"),
        ("set", "ess_base_vpid", "7"),
        ("set", "ess_base_vpid", "1"),  # the first host's daemon, asked of the second host's service
        ("set", "orte_node_regex", "a;touch /tmp/x"),
    ],
)
def test_an_orted_line_mpirun_would_not_produce_is_refused(orted_words, tamper):
    plan, words = orted_words
    argv = orted_argv(words)
    if tamper[0] == "add":
        argv = argv + tamper[1]
    else:
        i = argv.index(tamper[1])
        argv = argv[: i + 1] + [tamper[2]] + argv[i + 2 :]
    with pytest.raises(OrtedRefused):
        check_orted(argv, plan, _MPIRUN_ENV, vpid=2)


def test_the_service_starts_nothing_before_it_has_the_plan(service, orted_words):
    _, words = orted_words
    assert _ask(service, words) is None
    assert service.launches == 0 and service.refused == 1


def test_a_signed_request_with_extra_orted_options_starts_nothing(service, orted_words, tmp_path):
    plan, words = orted_words
    service.expect(plan, 1)
    marker = tmp_path / "pwned"
    assert _ask(service, words + ["-mca", "orte_fork_agent", "/usr/bin/touch"]) is None
    assert _ask(service, ["touch", str(marker)]) is None
    assert _ask(service, "orted --version") is None
    assert service.launches == 0 and service.refused == 3 and not marker.exists()


@pytest.mark.parametrize("credentials", [TASK, RANK, wire.Credentials.of(wire.new_secret(), wire.ROLE_EXEC)])
def test_only_the_exec_roles_key_reaches_the_service(service, orted_words, credentials):
    plan, words = orted_words
    service.expect(plan, 1)
    with pytest.raises(ConnectionError):
        _ask(service, words, credentials)
    assert settle(lambda: service.refused == 1)
    assert service.launches == 0


def test_a_plain_connection_is_refused(service):
    with socket.create_connection(("127.0.0.1", service.port)) as sock:
        sock.sendall(b'{"words": ["orted"]}\n' * 4)
        assert hung_up(sock)
    assert settle(lambda: service.refused == 1) and service.launches == 0


def test_one_orted_per_host_then_the_service_stops_listening(service, orted_words):
    plan, words = orted_words
    service.expect(plan, 1)
    conn = wire.connect(("127.0.0.1", service.port), EXEC, timeout=5)
    conn.send({"words": words})
    conn.sock.settimeout(10)
    assert "started" in conn.recv()  # a real orted; its HNP is gone, so it ends by itself
    assert service.launches == 1 and len(service.launched) == 1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", service.port), timeout=2).close()
    assert "exit" in conn.recv()
    conn.close()


@pytest.mark.parametrize("partition", [1, 3])
def test_a_task_that_mpirun_never_asks_closes_its_service_at_once(tmp_path, partition):
    plan = _plan(tmp_path, hosts=2, per_host=2)  # partitions 0 and 2 lead their hosts; 1 and 3 are never asked
    svc = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    try:
        svc.expect(plan, partition)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", svc.port), timeout=2).close()
    finally:
        svc.close()


def test_orted_command_is_split_without_a_shell():
    words = ["PATH=/usr/bin:$PATH", ";", "export", "PATH", ";", "/usr/bin/orted", "-mca", "orte_hnp_uri",
             '"123.0;tcp://127.0.0.1:5000"', "-mca", "plm", "rsh"]
    assert orted_argv(words) == ["orted", "-mca", "orte_hnp_uri", "123.0;tcp://127.0.0.1:5000", "-mca", "plm", "rsh"]
    with pytest.raises(ValueError, match="other than orted"):
        orted_argv(["rm", "-rf", "/"])


def test_each_exec_service_gives_its_orted_a_session_directory_of_its_own():
    first = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    second = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    dirs = [svc._env["OMPI_MCA_orte_tmpdir_base"] for svc in (first, second)]
    assert dirs[0] != dirs[1] and all(os.path.isdir(d) for d in dirs)
    first.close()
    second.close()
    assert not any(os.path.exists(d) for d in dirs)
