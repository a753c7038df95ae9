"""``launcher="torch"`` on a real ``local[2]`` SparkSession: unmodified torchrun code (DDP, FSDP, accelerate)
with every feature of the engine, and a torch job in an environment that has no Horovod at all."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner, RunCancelledError, WrongLauncherError
from tests.conftest import wait_no_run_processes
from tests.integration import torch_jobs
from tests.integration.test_runner import run_folders_left, train_in_background

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]
ROOT = Path(__file__).resolve().parents[2]


def test_ddp_trains_in_sync_with_torchruns_environment_reports_commits_and_resumes(spark, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_horovod.ranks")
    reports = []
    runner = HorovodRunner(2, launcher="torch", spark=spark, artifact_dir=tmp_path / "first", on_report=reports.append,
                           dataset=spark.range(40))
    result = runner.run(torch_jobs.ddp_job, steps=4, use_dataset=True)
    first, second = result["ranks"]
    assert first["weights"] == second["weights"]  # DDP broadcast rank 0's weights and averaged the gradients
    assert [r["rows"] for r in result["ranks"]] == [20, 20]  # each rank read its own shard of dataset=
    envs = [r["env"] for r in result["ranks"]]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "2", "0", "2"), ("1", "2", "1", "2")]  # local[2]: one executor, one torch node of two
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {runner.last_run.run_id}
    assert {e["GLOO_SOCKET_IFNAME"] for e in envs} == {"lo"} and {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert [r["horovod_env"] for r in result["ranks"]] == [[], []]  # torch's contract only
    assert [r["runtime"] for r in result["ranks"]] == [(0, 2, 0), (1, 2, 1)]
    # rank 0's store was up before any rank connected: no client retried a second later
    assert max(r["init_s"] for r in result["ranks"]) < 1.0
    assert "[rank 1] rank 1 of 2 up on %s:%s" % (envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"]) in caplog.text
    assert reports and reports[-1].step == 3 and reports[-1].metrics["loss"] == pytest.approx(result["loss"])
    assert [v["step"] for v in runner.last_run.checkpoints][-1] == 3
    checkpoint = Path(runner.last_run.checkpoint_path)
    assert (checkpoint / "model.pt").exists()

    resumed = HorovodRunner(2, launcher="torch", spark=spark, resume_from=checkpoint).run(torch_jobs.ddp_job, steps=6)
    assert [r["start"] for r in resumed["ranks"]] == [4, 4]  # every rank loaded step 3's checkpoint


def test_accelerate_function_runs_unmodified_on_every_rank(spark):
    result = HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.accelerate_job, steps=2)
    assert result["processes"] == 2 and result["index"] == 0 and result["distributed"] == "DistributedType.MULTI_CPU"
    assert result["batches"] == 4  # 64 rows, batches of 8, split between two processes
    assert result["weights"][0] == result["weights"][1]  # gradients were averaged across the ranks


def test_fsdp_shards_the_model_between_the_ranks_and_rank_0_commits_the_full_state(spark, tmp_path):
    runner = HorovodRunner(2, launcher="torch", spark=spark, artifact_dir=tmp_path / "fsdp")
    first, second = runner.run(torch_jobs.fsdp_job, steps=3)
    assert first["full"] == second["full"]  # one model, gathered from both ranks' shards
    assert first["local"]["0.weight"] + second["local"]["0.weight"] == 8 * 16  # each rank holds half of it
    assert first["local"]["0.weight"] < 8 * 16
    assert runner.last_run.checkpoints[-1]["step"] == 3  # the committed version (a first one may come with the file)
    assert (Path(runner.last_run.checkpoint_path) / "model.pt").exists()


def test_a_torch_rank_that_raises_fails_the_run_with_its_traceback_while_the_other_waits(spark):
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.failing_ddp_job, fail_rank=1)
    assert time.monotonic() - started < 30  # rank 0, blocked in all_reduce, was stopped: no torch timeout
    err = info.value
    assert err.rank == 1 and err.host == "hvdhost0"
    assert "ValueError: rank 1 lost its data" in str(err)
    assert "failing_ddp_job" in err.remote_traceback


def test_cancel_mid_torch_training_interrupts_the_job_and_leaves_no_process(spark, tmp_path):
    runner = HorovodRunner(2, launcher="torch", spark=spark)
    thread, errors = train_in_background(runner, tmp_path, torch_jobs.slow_ddp_job)
    runner.cancel()
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], RunCancelledError)
    assert run_folders_left(runner) == []
    assert wait_no_run_processes(10.0) == []
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


def test_timeline_is_refused_under_torch_when_the_runner_is_made():
    with pytest.raises(ValueError, match="runs no Horovod"):
        HorovodRunner(2, launcher="torch", timeline=True)


def test_hvd_init_kept_under_the_torch_launcher_fails_the_run_naming_the_fix():
    """Every rank would be a Horovod world of one (nothing averaged, a "success"): the rank's hvd.init()
    raises instead. np < 0: the same rank process as on Spark, without a barrier stage."""
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(-2, launcher="torch").run(torch_jobs.horovod_job_kept_under_torch)
    err = info.value
    assert type(err).__name__ == "WrongLauncherError" and isinstance(err, WrongLauncherError), type(err).__mro__
    assert 'hvd.init() was called in a rank started with launcher="torch"' in str(err)
    assert 'launcher="gloo" or launcher="mpirun"' in str(err)


def _environment_without_horovod(tmp_path: Path) -> Path:
    """A virtualenv that holds everything this one does except Horovod: its site-packages links
    every entry of ours but ``horovod`` and its metadata (made in milliseconds, nothing installed)."""
    import sysconfig

    venv = tmp_path / "no-horovod"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = venv / ours.relative_to(sys.prefix)
    for entry in ours.iterdir():
        if not entry.name.lower().startswith("horovod"):
            (theirs / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


def test_a_torch_job_runs_where_horovod_is_not_installed(tmp_path):
    python = _environment_without_horovod(tmp_path)
    script = textwrap.dedent("""
        import importlib.util, sys
        assert importlib.util.find_spec("horovod") is None, "horovod is importable"
        from airflow_provider_horovod import HorovodRunner
        from pyspark.sql import SparkSession
        sys.path.insert(0, %r)
        from tests.integration import torch_jobs
        import cloudpickle
        cloudpickle.register_pickle_by_value(torch_jobs)
        local = HorovodRunner(-2, launcher="torch").run(torch_jobs.ddp_job, steps=2)
        assert local["ranks"][0]["weights"] == local["ranks"][1]["weights"]
        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
        result = HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.ddp_job, steps=2)
        assert result["ranks"][0]["weights"] == result["ranks"][1]["weights"]
        spark.stop()
        try:
            HorovodRunner(2, launcher="gloo").run(torch_jobs.ddp_job)
        except Exception as err:
            print("GLOO:", type(err).__name__, err)
        print("OK", [r["rank"] for r in local["ranks"]])
    """ % str(ROOT))
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "PYSPARK_DRIVER_PYTHON": str(python)}
    done = subprocess.run([str(python), "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK [0, 1]" in done.stdout  # np < 0 on the driver, then np = 2 on local[2]
    assert "GLOO: TrainingStackError Horovod is not installed" in done.stdout  # the Horovod launchers still say so
