"""The warm process's decision (``rank/warm.py``): which environments it may fork a rank for."""

from __future__ import annotations

from airflow_provider_horovod.runner.launchers import read_after_fork, warm_modules
from airflow_provider_horovod.runner.launchers.processes import warm_key
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


def test_a_python_worker_keeps_one_warm_process_per_key_and_at_most_two(tmp_path, monkeypatch):
    """``start_warm`` as a barrier task calls it: real warm processes (importing nothing here)."""
    import os

    from airflow_provider_horovod.runner.launchers import processes
    from airflow_provider_horovod.runner.names import TaskDir

    monkeypatch.setattr(processes, "_kept", {})
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}

    def task(name: str) -> TaskDir:
        (tmp_path / name).mkdir(mode=0o700)
        return TaskDir(tmp_path / name)

    try:
        a = processes.start_warm(task("a"), env, ())
        again = processes.start_warm(task("b"), {**env, "HVDRUNNER_PLAN": "/elsewhere"}, ())
        assert again is a and (tmp_path / "b" / "warm.sock").resolve() == (tmp_path / "a" / "warm.sock").resolve()
        other = processes.start_warm(task("c"), {**env, "OMP_NUM_THREADS": "3"}, ())
        assert other is not a and a.proc.poll() is None  # both stacks kept
        third = processes.start_warm(task("d"), {**env, "OMP_NUM_THREADS": "4"}, ())
        assert a.proc.wait(5) is not None and other.proc.poll() is None and third.proc.poll() is None  # the oldest went
        assert oct((tmp_path / "d" / "warm.sock").resolve().stat().st_mode & 0o777) == "0o600"
    finally:
        for kept in list(processes._kept.values()):
            kept.stop()
