"""Warm rank processes (issue 51 item 1): every rank is forked by its Spark Python worker's warm process
(``rank/warm.py``) through a stub started exactly as the worker was (``rank/stub.py``), under mpirun
(as orted's child), Gloo and torch, and keeps every guarantee of a fresh one: its launcher's
environment, its folder and module path, the thread count its environment asks for, CUDA untouched
before it starts, its own exit status and signal, and nothing left when its stub or the run is
stopped. Real Spark, real mpirun and Horovod ranks; ``HVDRUNNER_WARM=0`` gives the cold start to
compare with."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner, RunCancelledError
from tests.conftest import ours, wait_no_run_processes
from tests.integration import jobs, torch_jobs, warm_jobs
from tests.integration.test_runner import train_in_background

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

LAUNCHERS = ["mpirun", "gloo", "torch"]
WARM = "airflow_provider_horovod.runner.rank.warm"
STUB = "airflow_provider_horovod.runner.rank.stub"
WORKER = "airflow_provider_horovod.runner.rank.worker"
# the contract names a rank is told who it is by, under every launcher, and what its imports read
CONTRACT = ("HVDRUNNER_RANK", "HVDRUNNER_SIZE", "HVDRUNNER_LOCAL_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_CONTROLLER",
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "PATH")


def slow_job(launcher: str):
    return torch_jobs.slow_ddp_job if launcher == "torch" else jobs.slow_job


def kind(launcher: str) -> str:
    return "torch" if launcher == "torch" else "horovod"


def run_whoami(spark, launcher: str, **env) -> list[dict]:
    return HorovodRunner(2, launcher=launcher, spark=spark, env=env or None).run(warm_jobs.whoami_job, kind(launcher))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ranks_fork_from_the_workers_kept_warm_process_and_see_what_a_cold_rank_sees(spark, launcher):
    cold = run_whoami(spark, launcher, HVDRUNNER_WARM="0")
    first = run_whoami(spark, launcher)
    second = run_whoami(spark, launcher)
    # one warm process for both tasks of the stage (one executor: one pyspark daemon), the same for the next run
    assert len({seen["ppid"] for seen in first}) == 1, first
    assert {seen["ppid"] for seen in second} == {seen["ppid"] for seen in first}
    assert _is_daemon(_owner(first[0]["ppid"]))
    for rank in (0, 1):
        c, w, again = cold[rank], first[rank], second[rank]
        assert not any(WARM in a for a in c["parent"]), c["parent"]  # cold: the task's (or orted's) own child
        assert any(WARM in a for a in w["parent"]), w["parent"]  # warm: forked by the warm process
        assert again["pid"] != w["pid"]  # a new fork
        assert WORKER in w["cmdline"] and STUB not in w["cmdline"]  # shown as the worker, as a cold rank is
        names = lambda seen: set(seen["env"]) - {"HVDRUNNER_WARM"}  # noqa: E731
        assert names(w) == names(c), names(w) ^ names(c)
        assert {k: w["env"].get(k) for k in CONTRACT} == {k: c["env"].get(k) for k in CONTRACT}
        for what in ("cwd", "argv0", "path", "main", "threads", "rank"):
            assert w[what] == c[what], what
        assert w["cuda_before"] is False and c["cuda_before"] is False


def test_an_environment_the_imports_read_differently_gets_a_fresh_warm_process(spark):
    """``OMP_NUM_THREADS`` is read when torch imports (PySpark gives its workers ``spark.task.cpus``, 1
    here): a run that sets another never forks from a warm process that imported without it (no state
    of one run's imports reaches another's)."""
    plain = run_whoami(spark, "gloo")
    assert {seen["threads"] for seen in plain} == {1}
    threaded = run_whoami(spark, "gloo", OMP_NUM_THREADS="2")
    for rank in (0, 1):
        assert any(WARM in a for a in threaded[rank]["parent"])
        assert threaded[rank]["ppid"] not in {seen["ppid"] for seen in plain}
        assert threaded[rank]["threads"] == 2 and threaded[rank]["env"]["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize("how", ["signal", "exit"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_forked_ranks_own_signal_or_exit_code_is_reported_as_its_own(spark, launcher, how):
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(2, launcher=launcher, spark=spark).run(warm_jobs.ends_by_itself_job, how, kind(launcher))
    assert time.monotonic() - started < 60
    text = str(info.value)
    assert info.value.rank == 1, text
    if how == "signal":
        assert "SIGABRT" in text or "signal 6" in text, text
    else:
        assert "exited with code 3" in text or "exit code 3" in text or "exited with status 3" in text, text


def _ranks_of_this_session() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {"stub": [], "forked": []}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            if not ours(proc):
                continue
            if cmd[1:3] == ["-m", STUB]:  # not mpirun or its reaper, which name it too
                found["stub"].append(proc)
            elif WORKER in cmd and any(WARM in a for a in proc.parent().cmdline()):
                found["forked"].append(proc)
        except psutil.Error:
            continue
    return found


def _rank_of_stub(proc: psutil.Process) -> int:
    env = proc.environ()
    return int(env.get("HVDRUNNER_RANK") or env["OMPI_COMM_WORLD_RANK"])


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_whose_stub_is_killed_goes_at_once_and_nothing_is_left(spark, launcher, tmp_path):
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path, job=slow_job(launcher))
    try:
        ranks = _ranks_of_this_session()
        assert len(ranks["stub"]) == 2 and len(ranks["forked"]) == 2, ranks
        stub = next(p for p in ranks["stub"] if _rank_of_stub(p) == 1)
        forked = set(ranks["forked"])
        stub.kill()
        _, alive = psutil.wait_procs(list(forked), timeout=3.0)
        assert len(alive) <= 1  # rank 1 went with its stub at once (rank 0 may still be ending)
    finally:
        runner.cancel()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], (HorovodRunError, RunCancelledError)), errors
    assert wait_no_run_processes(10.0) == []


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_cancel_ends_every_forked_rank_and_keeps_the_warm_process_idle(spark, launcher, tmp_path):
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path, job=slow_job(launcher))
    ranks = _ranks_of_this_session()
    assert len(ranks["forked"]) == 2, ranks
    servers = {p.parent() for p in ranks["forked"]}
    runner.cancel()
    thread.join(60)
    assert [type(e) for e in errors] == [RunCancelledError]
    assert wait_no_run_processes(10.0) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks["forked"])
    for server in servers:  # kept for the worker's next task, with no rank of this run under it
        if server.is_running():
            assert [c for c in server.children() if c.status() != psutil.STATUS_ZOMBIE] == []



def _owner(warm_pid: int) -> int:
    """The owner a warm process was started for (``WARM FD SOCKET OWNER MODULE...``)."""
    cmd = psutil.Process(warm_pid).cmdline()
    return int(cmd[cmd.index(WARM) + 3])


def _folder(warm_pid: int) -> str:
    cmd = psutil.Process(warm_pid).cmdline()
    return os.path.dirname(cmd[cmd.index(WARM) + 2])


def _is_daemon(pid: int) -> bool:
    """The executor's pyspark daemon, not one of the Python workers it forked (the same command line)."""
    proc = psutil.Process(pid)
    return "pyspark.daemon" in " ".join(proc.cmdline()) and "pyspark.daemon" not in " ".join(proc.parent().cmdline())


def _python_workers(daemon: int) -> set[int]:
    return {p.pid for p in psutil.Process(daemon).children() if p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_run_after_killed_tasks_forks_from_the_same_warm_process_on_new_python_workers(spark, launcher, tmp_path):
    """Spark ends the Python worker of every task it kills (a restart's old stage, an interrupted job,
    its kill timeout): here SIGKILL, as Spark's daemon does. The warm process belongs to the
    executor's pyspark daemon and outlives them; the next run's tasks, on new Python workers, fork
    from it."""
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path, job=slow_job(launcher))
    try:
        servers = {p.parent().pid for p in _ranks_of_this_session()["forked"]}
        assert len(servers) == 1, servers
        server = servers.pop()
        daemon = _owner(server)
        assert _is_daemon(daemon)
        old_workers = _python_workers(daemon)
        for pid in old_workers:  # the tasks' Python workers (and any idle one): all of them go
            os.kill(pid, signal.SIGKILL)
        thread.join(60)
    finally:
        runner.cancel()
        thread.join(60)
    assert len(errors) == 1, errors  # the stage lost its tasks
    log = Path(_folder(server), "warm.log")
    assert _running(server), log.read_text() if log.exists() else "no log"
    after = run_whoami(spark, launcher)
    assert {seen["ppid"] for seen in after} == {server}, log.read_text() if log.exists() else "no log"
    assert not old_workers & _python_workers(daemon)
    assert "rank 0 forked" in log.read_text()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stale_warm_folder_is_replaced_and_the_next_run_forks_warm_again(spark, launcher):
    before = run_whoami(spark, launcher)
    (server,) = {seen["ppid"] for seen in before}
    folder = _folder(server)
    os.kill(server, signal.SIGKILL)  # nothing of it runs: its folder and socket stay, the socket refuses
    psutil.wait_procs([psutil.Process(server)], timeout=5)
    assert os.path.exists(os.path.join(folder, "warm.sock"))
    after = run_whoami(spark, launcher)
    servers = {seen["ppid"] for seen in after}
    assert len(servers) == 1 and server not in servers, servers
    (fresh,) = servers
    assert any(WARM in a for a in after[0]["parent"]) and _folder(fresh) == folder
    again = run_whoami(spark, launcher)
    assert {seen["ppid"] for seen in again} == {fresh}


@pytest.mark.parametrize("trap", ["mode", "symlink", "other user"])
def test_a_warm_folder_that_is_not_private_and_ours_is_never_used(spark, trap, tmp_path):
    """The warm process still listens, reachable at the folder's name: a task that trusted the name
    would hand it the rank's descriptors. It falls back to a warm process of its Python worker's own."""
    if trap == "other user" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    before = run_whoami(spark, "gloo")
    (server,) = {seen["ppid"] for seen in before}
    folder = _folder(server)
    moved = str(tmp_path / "moved")
    after: list[dict] = []
    try:
        if trap == "mode":
            os.chmod(folder, 0o755)
        elif trap == "symlink":
            os.rename(folder, moved)  # the socket goes with its folder: the warm process answers there
            os.symlink(moved, folder)
        else:
            os.chown(folder, 65534, 65534)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(os.path.join(folder, "warm.sock"))  # the trap is live
        after = run_whoami(spark, "gloo")
        for seen in after:
            assert seen["ppid"] != server
            assert any(WARM in a for a in seen["parent"]), seen["parent"]  # warm all the same: the worker's own
            assert _owner(seen["ppid"]) != _owner(server)
    finally:  # the trap's warm process, and the workers' own (they would live as long as their workers)
        for pid in {server, *(seen["ppid"] for seen in after)}:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        if os.path.islink(folder):
            os.unlink(folder)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(moved, ignore_errors=True)


def test_nothing_of_the_shared_warm_process_is_left_once_the_session_stops(tmp_path):
    """Its own driver and session: the warm process the stage's two tasks shared, and its folder, go
    with the executor (the pyspark daemon ends when Spark stops)."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, %r)
        import cloudpickle, psutil
        from pyspark.sql import SparkSession
        from airflow_provider_horovod import HorovodRunner
        from tests.integration import warm_jobs
        cloudpickle.register_pickle_by_value(warm_jobs)
        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
        seen = HorovodRunner(2, launcher="gloo", spark=spark).run(warm_jobs.whoami_job)
        servers = sorted({s["ppid"] for s in seen})
        cmd = psutil.Process(servers[0]).cmdline()
        print("SEEN", json.dumps([servers, int(cmd[cmd.index(%r) + 3])]), flush=True)
        spark.stop()
    """ % (str(Path(__file__).resolve().parents[2]), WARM))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    servers, owner = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN"))[5:])
    assert len(servers) == 1, servers  # shared by the stage's two tasks
    deadline = time.monotonic() + 10
    while _running(servers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(servers[0]) and not _running(owner)
    assert glob.glob(os.path.join(tempfile.gettempdir(), "hvdwarm-%d-*" % owner)) == []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
