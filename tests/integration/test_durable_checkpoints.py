"""Durable checkpoints on real Horovod ranks: every checkpoint rank 0 completes is committed as a
version while training runs, so a run that is killed keeps them and the next one resumes from the
newest (``HorovodRunner(np, artifact_dir=...)``; the Airflow side is in ``on_deployment/test_deployment.py``)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_horovod import ArtifactError, HorovodRunner
from airflow_provider_horovod.runner.driver import versions
from tests.conftest import wait_no_run_processes
from tests.integration import jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]
ROOT = Path(__file__).resolve().parents[2]


def first_version_while_running(artifact_dir: Path, runner_thread: threading.Thread) -> list[float]:
    """When (monotonic) the first version appeared, while ``runner_thread`` was still running."""
    seen: list[float] = []
    while runner_thread.is_alive() and not seen:
        if versions.committed(artifact_dir):
            seen.append(time.monotonic())
        time.sleep(0.05)
    return seen


@pytest.mark.parametrize(("launcher", "explicit"), [("mpirun", False), ("gloo", True)])
def test_versions_are_committed_while_the_run_trains_and_last_run_lists_them(tmp_path, launcher, explicit):
    dest = tmp_path / "a"
    runner = HorovodRunner(-2, launcher=launcher, artifact_dir=dest, keep_checkpoints=2)
    thread = threading.Thread(target=runner.run, args=(jobs.durable_job,), kwargs={"steps": 5, "pause": 0.5,
                                                                                    "explicit": explicit})
    thread.start()
    seen = first_version_while_running(dest, thread)
    thread.join(120)
    assert seen, "no version was committed while the run trained"
    run = runner.last_run
    assert run.status == "success"
    listed = run.checkpoints
    assert len(listed) >= 2 and [v["seq"] for v in listed] == sorted(v["seq"] for v in listed)
    kept = versions.committed(dest)
    assert [v.seq for v, _ in kept] == [v["seq"] for v in listed][-2:]  # keep_checkpoints=2
    newest, path = kept[-1]
    assert (path / "step.txt").read_text() == "4" and newest.size == 4096 + 1
    if explicit:  # commit_checkpoint: the step and metrics are in the marker (renames before the first call
        steps = [v["step"] for v in listed if v["step"] is not None]  # still made versions, with no step)
        assert steps == sorted(steps) and newest.step == 4 and newest.metrics == {"loss": 0.2}
    assert any(v["sent"] == ["step.txt"] for v in listed)  # weights.bin unchanged: it did not travel again
    assert Path(run.checkpoint_path) == dest / "checkpoints"  # the run ended: its final checkpoint


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_killed_driver_keeps_its_committed_versions_and_the_next_run_resumes_from_the_newest(tmp_path, launcher):
    dest, marker = tmp_path / "killed", tmp_path / "step"
    output = tmp_path / "driver.log"
    with output.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.scenarios.durable_driver", launcher,
                                 str(dest), str(marker)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and len(versions.committed(dest)) < 2:
            time.sleep(0.1)
        assert len(versions.committed(dest)) >= 2, output.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything in its session: nothing runs after
        proc.wait(30)
    assert wait_no_run_processes(10.0) == []
    newest, path = versions.committed(dest)[-1]
    assert not (dest / "_RUN.json").exists()  # the run never ended ...
    step = int((path / "step.txt").read_text())  # ... and its newest version is whole
    assert dict(newest.files) == {"step.txt": len(str(step)), "weights.bin": 4096}
    resumed = HorovodRunner(-2, launcher=launcher, artifact_dir=tmp_path / "next", resume_from=path)
    assert resumed.run(jobs.durable_job, steps=step + 2, pause=0.0)["start"] == step + 1


def test_versions_travel_from_the_barrier_tasks_over_the_stream(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("HVDRUNNER_ARTIFACT_TRANSPORT", "stream")
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=tmp_path / "a")
    assert runner.run(jobs.durable_job, steps=3, pause=1.0) == {"start": 0}
    assert [v["seq"] for v in runner.last_run.checkpoints][:1] == [1]
    newest, path = versions.committed(tmp_path / "a")[-1]
    assert (path / "step.txt").read_text() == "2"


@pytest.fixture
def small_store(tmp_path):
    """A real 16 MiB file system (tmpfs) for the artifact dir, so that it can really fill up."""
    where = tmp_path / "store"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): %s" % mounted.stderr.decode().strip())
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its file system has no space left."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_store_that_fills_up_mid_run_keeps_the_version_before_newest_and_names_the_path_and_cause(
        spark, small_store, launcher):
    dest = small_store / "a"
    runner = HorovodRunner(2, launcher=launcher, spark=spark, artifact_dir=dest)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = runner.run(jobs.durable_job, steps=8, pause=0.5)
        except Exception as err:  # noqa: BLE001 - what the user sees is the point
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline and len(versions.committed(dest)) < 2:
        time.sleep(0.05)
    before = versions.committed(dest)
    assert len(before) >= 2, outcome
    fill(small_store)  # the disk is full from here on: every later version and the final hand-over fail
    thread.join(180)
    assert not thread.is_alive()
    err = outcome.get("error")
    assert isinstance(err, ArtifactError), outcome
    assert str(dest) in str(err) and "No space left on device" in str(err)
    after = versions.committed(dest)
    assert after[-1][0].seq >= before[-1][0].seq  # the versions before the disk filled are still offered ...
    newest, path = after[-1]
    assert newest.step is None and dict(newest.files) == {"step.txt": 1, "weights.bin": 4096}  # ... each one whole
    assert (path / "weights.bin").stat().st_size == 4096
    assert int((path / "step.txt").read_text()) < 7  # the steps after the disk filled were never committed
    assert {v["seq"] for v in runner.last_run.checkpoints} >= {v.seq for v, _ in after}  # listed by the run
    marker = dest / "_RUN.json"
    assert not marker.exists() or json.loads(marker.read_text())["complete"] is False  # never a complete run
