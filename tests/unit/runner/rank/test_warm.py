"""The warm process's decision (``rank/warm.py``): which environments it may fork a rank for."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import time

import pytest

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.launchers import read_after_fork, warm_modules
from airflow_provider_horovod.runner.launchers.processes import warm_key
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.rank.warm import differing_names

BASE = {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HVDRUNNER_PLAN": "/tmp/a/plan.json"}


def test_a_ranks_own_contract_and_the_names_read_after_the_fork_may_differ():
    rank = {**BASE, "HVDRUNNER_PLAN": "/tmp/b/plan.json", "HVDRUNNER_RANK": "1", "HOROVOD_RANK": "1",
            "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "RANK": "1", "MASTER_PORT": "2345",
            "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "3", "NCCL_SOCKET_IFNAME": "lo", "PWD": "/w"}
    assert differing_names(BASE, rank) == []


def test_a_name_an_import_reads_may_not_differ_nor_be_missing_nor_be_added():
    assert differing_names(BASE, {**BASE, "OMP_NUM_THREADS": "2"}) == ["OMP_NUM_THREADS"]
    assert differing_names(BASE, {k: v for k, v in BASE.items() if k != "PATH"}) == ["PATH"]
    assert differing_names(BASE, {**BASE, "PYTHONPATH": "/x", "LD_PRELOAD": "/y.so"}) == ["LD_PRELOAD", "PYTHONPATH"]
    assert not read_after_fork("OMP_NUM_THREADS") and not read_after_fork("PYTHONHASHSEED")


def test_the_workers_warm_process_is_kept_only_for_the_same_key():
    modules = warm_modules("gloo")
    assert warm_key(BASE, modules) == warm_key({**BASE, "HVDRUNNER_PLAN": "/tmp/c/plan.json"}, modules)
    assert warm_key(BASE, modules) != warm_key({**BASE, "OMP_NUM_THREADS": "2"}, modules)
    assert warm_key(BASE, modules) != warm_key(BASE, warm_modules("torch"))


def test_the_training_stack_is_imported_for_the_launcher_but_never_beside_tensorflow():
    assert "horovod.torch" in warm_modules("mpirun") and "horovod.torch" in warm_modules("gloo")
    assert "torch" in warm_modules("torch") and "horovod.torch" not in warm_modules("torch")
    assert "torch" not in warm_modules("gloo", b"...tensorflow.keras...")


def _warm_pid(path) -> int:
    """The warm process listening at ``path`` (its command line names the socket)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if str(path) in (proc.info["cmdline"] or []) and WARM in proc.info["cmdline"]:
            return proc.pid
    raise AssertionError("no warm process at %s" % path)


WARM = "airflow_provider_horovod.runner.rank.warm"


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """``start_warm`` as barrier tasks of one owner call it (this process stands in for the pyspark
    daemon): real warm processes importing nothing, their folders in the real temp folder (a
    socket's path must stay short); every one of them ended after the test."""
    from airflow_provider_horovod.runner.launchers import processes

    monkeypatch.setattr(processes, "warm_owner", os.getpid)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}
    made = []

    def start(name: str, extra: dict | None = None):
        (tmp_path / name).mkdir(mode=0o700)
        started = processes.start_warm(TaskDir(tmp_path / name), {**env, **(extra or {})}, ())
        made.append(started)
        return started

    start.env = env
    yield start
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), names.WARM_DIR_PREFIX % os.getpid() + "*")):
        with contextlib.suppress(Exception):
            os.kill(_warm_pid(os.path.join(folder, names.WARM_SOCKET)), signal.SIGKILL)
        if os.path.islink(folder) or not os.path.isdir(folder):
            os.unlink(folder)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_the_owners_tasks_share_one_warm_process_per_key_and_at_most_two(kept, tmp_path):
    a = kept("a")
    again = kept("b", {"HVDRUNNER_PLAN": "/elsewhere"})  # another task of the owner (another Python worker)
    assert again.socket_path == a.socket_path and (tmp_path / "b" / "warm.sock").resolve() == (tmp_path / "a" / "warm.sock").resolve()
    first = _warm_pid(a.socket_path)
    assert os.path.basename(os.path.dirname(a.socket_path)).startswith("hvdwarm-%d-k" % os.getpid())
    assert oct(os.stat(a.socket_path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(a.socket_path)).st_mode & 0o777) == "0o700"
    other = kept("c", {"OMP_NUM_THREADS": "3"})
    assert other.socket_path != a.socket_path and _alive(first)  # both stacks kept
    second = _warm_pid(other.socket_path)
    kept("b2", {"HVDRUNNER_PLAN": "/again"})  # a is used again: c is now the least recently used
    third = kept("d", {"OMP_NUM_THREADS": "4"})
    deadline = time.monotonic() + 5
    while _alive(second) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(second) and _alive(first) and _alive(_warm_pid(third.socket_path))  # the least recently used went
    assert not os.path.exists(os.path.dirname(other.socket_path))


def test_the_warm_process_leaves_the_task_folder_out_of_its_environment(kept, tmp_path):
    """It outlives the task that started it: a task's janitor ends what names the task's folder."""
    import psutil

    from airflow_provider_horovod.runner import procs

    plan = str(tmp_path / "a" / "plan.json")
    a = kept("a", {"HVDRUNNER_PLAN": plan, "HVDRUNNER_CHANNEL": "127.0.0.1:1"})
    env = psutil.Process(_warm_pid(a.socket_path)).environ()
    assert "HVDRUNNER_PLAN" not in env and env["HVDRUNNER_CHANNEL"] == "127.0.0.1:1" and env["PATH"] == kept.env["PATH"]
    assert procs.working_in([str(tmp_path / "a")]) == []


def test_a_stale_folder_is_replaced_and_the_next_task_gets_a_live_warm_process(kept):
    a = kept("a")
    first = _warm_pid(a.socket_path)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(a.socket_path)  # nothing of it ran: its folder stays, its socket refuses
    b = kept("b")
    assert b is not None and b.socket_path == a.socket_path
    assert _warm_pid(b.socket_path) != first
    from airflow_provider_horovod.runner.launchers.processes import probe

    assert probe(b.socket_path)


def _squat(kind: str, key_env: dict) -> str:
    """Put at the owner's folder for ``key_env``'s key what a task must not trust."""
    from airflow_provider_horovod.runner.launchers import processes

    folder = processes.warm_dir(os.getpid(), processes.warm_key(key_env, ()))
    if kind == "symlink":
        target = tempfile.mkdtemp(prefix="hvdtest-target-")
        os.symlink(target, folder)
    else:
        os.mkdir(folder, 0o700)
        if kind == "mode":
            os.chmod(folder, 0o755)
        else:
            os.chown(folder, 65534, 65534)
    return folder


@pytest.mark.parametrize("kind", ["symlink", "mode", "other user"])
def test_a_folder_that_is_not_ours_and_private_is_never_used(kept, kind):
    if kind == "other user" and os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    folder = _squat(kind, kept.env)
    try:
        assert kept("a") is None  # its own folder is the squatted one: the ranks start cold
        assert os.listdir(folder if kind != "symlink" else os.path.realpath(folder)) == []
    finally:
        if kind == "symlink":
            shutil.rmtree(os.path.realpath(folder), ignore_errors=True)


def test_a_pyspark_daemons_worker_is_told_from_a_worker_spark_started_itself():
    from airflow_provider_horovod.runner.launchers.processes import is_daemon_parent

    daemon = ["/usr/bin/python3", "-m", "pyspark.daemon"]
    assert is_daemon_parent(daemon, "pyspark.daemon", True, True)
    assert is_daemon_parent(["python", "-m", "my.daemon"], "my.daemon", True, True)  # spark.python.daemon.module
    assert not is_daemon_parent(daemon, "pyspark.worker", True, True)  # spark.python.use.daemon=false
    assert not is_daemon_parent(["java", "-cp", "x", "org.apache.spark.executor.Executor"], "pyspark.worker", True, True)
    assert not is_daemon_parent(daemon, "pyspark.daemon", False, True)  # another user's
    assert not is_daemon_parent(daemon, "pyspark.daemon", True, False)  # not the leader of this group
    assert not is_daemon_parent(["python", "-m", "pytest"], None, True, True)  # a driver (np < 0 keeps none)
