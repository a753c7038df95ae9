"""Timeline and rank 0's checkpoints come back to the driver, are committed atomically, and let
the next run resume; on real Horovod ranks in a real ``local[2]`` SparkSession."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from airflow_provider_horovod import ArtifactError, HorovodRunError, HorovodRunner, RunCancelledError
from airflow_provider_horovod.runner import transfer
from airflow_provider_horovod.runner.records import Layout
from tests.integration import jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


def test_timeline_comes_back_as_valid_json_with_summary_and_picture(spark, tmp_path):
    runner = HorovodRunner(2, launcher="gloo", spark=spark, timeline=True, artifact_dir=tmp_path / "a")
    result = runner.run(jobs.checkpoint_job, epochs=2)
    run = runner.last_run
    events = json.loads(Path(run.timeline_path).read_text())
    assert any(e.get("name") == "ALLREDUCE" for e in events)
    summary = json.loads(Path(run.timeline_summary_path).read_text())
    assert summary["operations"]["ALLREDUCE"]["count"] >= 2
    assert 0 < summary["operations"]["ALLREDUCE"]["share_of_wall"] <= 1
    svg = Path(run.timeline_picture_path).read_text()
    assert svg.startswith("<svg") and "ALLREDUCE" in svg
    # rank 0's timeline is the one that comes back
    assert result["timeline_env"][0].endswith("/artifacts/timeline.json")
    assert "/artifacts/" not in result["timeline_env"][1]
    assert Layout(tmp_path / "a").read_run_marker().status == "success"


def test_timeline_off_sets_no_horovod_timeline_anywhere(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", str(tmp_path / "inherited.json"))  # inherited by executors
    result = HorovodRunner(2, launcher="mpirun", spark=spark).run(jobs.checkpoint_job, epochs=1)
    assert result["timeline_env"] == [None, None]


# Rank 0's task is on the driver's host here, so the driver copies its folder; "stream" turns that
# off and sends the files over the channel, as from another host.
@pytest.mark.parametrize(("launcher", "transport"), [("mpirun", "copy"), ("gloo", "stream")])
def test_checkpoint_round_trips_and_resumes_after_a_failed_run(spark, tmp_path, monkeypatch, launcher, transport):
    if transport == "stream":
        monkeypatch.setenv("HVDRUNNER_ARTIFACT_TRANSPORT", "stream")
    first = HorovodRunner(2, launcher=launcher, spark=spark, artifact_dir=tmp_path / "try-1")
    with pytest.raises(HorovodRunError, match="failing at epoch 2"):
        first.run(jobs.checkpoint_job, epochs=4, fail_at=2, in_flight_at_failure=True)
    assert first.last_run.artifact_transport == transport
    marker = Layout(tmp_path / "try-1").read_run_marker()
    assert marker.status == "failed" and marker.complete is True
    ckpt = tmp_path / "try-1" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch-0.pt", "epoch-1.pt"]  # no half-written file
    state = torch.load(ckpt / "epoch-1.pt")
    assert state["epoch"] == 1

    second = HorovodRunner(2, launcher=launcher, spark=spark, artifact_dir=tmp_path / "try-2", resume_from=ckpt)
    result = second.run(jobs.checkpoint_job, epochs=4)
    assert result["start"] == 2  # resumed after epoch 1
    assert all(seen and seen.endswith("resume") for seen in result["resume_seen"])  # every rank, same answer
    final = torch.load(Path(second.last_run.checkpoint_path) / "epoch-3.pt")
    assert final["epoch"] == 3
    assert [w.flatten().tolist() for w in final["model"].values()] == result["weights"]
    assert Layout(tmp_path / "try-1").read_run_marker() == marker  # earlier run untouched


def test_local_mode_resume_and_checkpoint(tmp_path):
    first = HorovodRunner(-2, launcher="gloo", artifact_dir=tmp_path / "one")
    first.run(jobs.checkpoint_job, epochs=2)
    second = HorovodRunner(-2, launcher="mpirun", artifact_dir=tmp_path / "two", resume_from=first.last_run.checkpoint_path)
    assert second.run(jobs.checkpoint_job, epochs=3)["start"] == 2


def test_unwritable_artifact_dir_fails_before_training(spark, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup())
    with pytest.raises(ArtifactError, match=str(blocker / "artifacts")):
        HorovodRunner(2, spark=spark, artifact_dir=blocker / "artifacts").run(jobs.checkpoint_job)
    assert set(tracker.getJobIdsForGroup()) == jobs_before


def test_artifact_dir_of_an_earlier_run_is_never_reused(spark, tmp_path):
    HorovodRunner(-2, launcher="gloo", artifact_dir=tmp_path / "a").run(jobs.checkpoint_job, epochs=1)
    with pytest.raises(ArtifactError, match="already holds the committed artifacts"):
        HorovodRunner(2, spark=spark, artifact_dir=tmp_path / "a").run(jobs.checkpoint_job, epochs=1)


@pytest.mark.parametrize("transport", ["copy", "stream"])
def test_cancel_during_artifact_transfer_leaves_the_folder_marked_incomplete(spark, tmp_path, monkeypatch, transport):
    # A slow link: the driver (this process) takes 0.1 s per 4 MiB, so 400 MiB is still on its way
    # when the cancel's grace runs out; the ranks' side is untouched.
    monkeypatch.setenv("HVDRUNNER_ARTIFACT_TRANSPORT", "auto" if transport == "copy" else "stream")
    if transport == "copy":
        real_step = transfer._copy_step
        monkeypatch.setattr(transfer, "COPY_CHUNK", 4 << 20)
        monkeypatch.setattr(transfer, "_copy_step", lambda *a: time.sleep(0.1) or real_step(*a))
    else:
        real_receive = transfer.receive_tree

        def slow_receive(conn, dest, *limits):
            recv_frame_to = conn.recv_frame_to  # one call per 4 MiB chunk
            conn.recv_frame_to = lambda *a, **k: time.sleep(0.1) or recv_frame_to(*a, **k)
            return real_receive(conn, dest, *limits)

        monkeypatch.setattr(transfer, "receive_tree", slow_receive)
    dest = tmp_path / "a"
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest)
    errors = []

    def run():
        try:
            runner.run(jobs.checkpoint_job, epochs=1, big_mb=400)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    incoming = None
    while time.monotonic() < deadline and incoming is None:
        for p in dest.glob(".incoming-*/checkpoints/big.bin.partial"):
            incoming = p
        time.sleep(0.05)
    assert incoming is not None, "the transfer never started"
    runner.cancel()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], RunCancelledError)
    assert runner.last_run.artifact_transport == transport
    marker = Layout(dest).read_run_marker()
    assert marker.status == "cancelled" and marker.complete is False
    assert not (dest / "checkpoints").exists()  # nothing half-copied looks like a checkpoint
    size = incoming.stat().st_size if transport == "copy" else None
    if transport == "stream":
        assert not incoming.exists()  # the stream's receiver removes a file cut off mid-transfer
    time.sleep(1)
    # and nothing is still being written after run() returned
    assert (incoming.stat().st_size if incoming.exists() else None) == size
    assert list(dest.glob(".incoming-*/checkpoints/big.bin")) == []
