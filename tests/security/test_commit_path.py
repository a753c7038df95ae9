"""Findings N1 (second half), N13 and N7 of issue #21, in the checkpoint commit path: a failed
upload is a failed run, never a complete (empty) marker; a crafted timeline cannot stop the
checkpoint's commit; the Horovod view reads a try's file list once per request."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from airflow_provider_horovod import ArtifactError, HorovodRunError, HorovodRunner
from airflow_provider_horovod.plugins import store as view_store
from airflow_provider_horovod.runner.driver import artifact_dir
from airflow_provider_horovod.runner import transfer, names
from airflow_provider_horovod.runner.records import Layout
from airflow_provider_horovod.runner.spec import RunSpec
from airflow_provider_horovod.runner.task.barrier import upload_artifacts
from tests.integration import jobs


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_an_upload_that_cannot_reach_the_driver_is_reported_as_a_failure(tmp_path):
    spec = RunSpec(run_id="r", secret=b"k" * 32, payload=b"", launcher="gloo", verbosity="all",
                   channel=("127.0.0.1", _closed_port()), env={}, driver_python="3.11", collect_artifacts=True)
    task = names.TaskDir(tmp_path)
    (task.artifacts / names.CHECKPOINTS_DIR).mkdir(parents=True)
    failure = upload_artifacts(spec, task)
    assert failure is not None and failure.rank == 0
    assert "did not reach the driver at 127.0.0.1:%d" % spec.channel[1] in failure.message


@pytest.mark.slow
def test_a_run_whose_upload_fails_fails_and_never_commits_a_complete_marker(tmp_path, monkeypatch):
    def refused(conn, root, proof_dir):
        raise ConnectionResetError("the driver's channel dropped the hand-over")

    monkeypatch.setattr(transfer, "offer_tree", refused)  # rank 0's task (np < 0: a thread of this process)
    runner = HorovodRunner(-1, launcher="gloo", artifact_dir=tmp_path / "a")
    with pytest.raises((HorovodRunError, ArtifactError), match="did not reach the driver"):
        runner.run(jobs.checkpoint_job, epochs=1)
    marker = Layout(tmp_path / "a").read_run_marker()
    assert marker.complete is False and marker.status != "success"


@pytest.mark.parametrize("event", [
    {"name": "\u00b2", "ph": "X", "pid": 1, "ts": 10, "dur": 0},  # a "ready" marker that is a digit, not an int
    {"name": "ALLREDUCE", "ph": "B", "pid": 1, "ts": float("inf")},  # an inf timestamp
])
def test_a_crafted_timeline_does_not_stop_the_checkpoint_commit(tmp_path, event):
    staging = tmp_path / "out" / ".incoming-x"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints" / "model.pt").write_bytes(b"weights")
    events = [{"name": "ALLREDUCE", "ph": "B", "pid": 1, "ts": 1}, event, {"name": "ALLREDUCE", "ph": "E", "pid": 1, "ts": 5}]
    (staging / "timeline.json").write_text(json.dumps(events))
    info = artifact_dir.commit(tmp_path / "out", staging, status="success", complete=True, run_id="r",
                            received=[{"path": "checkpoints/model.pt", "size": 7}])
    assert info.complete is True and info.checkpoint == "checkpoints"
    assert (tmp_path / "out" / "checkpoints" / "model.pt").read_bytes() == b"weights"
    assert Layout(tmp_path / "out").read_run_marker().complete is True
    assert info.timeline["timeline_error"].split(":")[0] in ("ValueError", "OverflowError")  # named, not raised


def test_the_view_reads_a_tries_file_list_once_not_once_per_file(tmp_path, monkeypatch):
    folder = tmp_path / "try-1"
    names_ = ["checkpoints/f-%04d.pt" % i for i in range(2000)]
    for rel in names_:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(b"x")
    (folder / "_ARTIFACTS.json").write_text(json.dumps({"status": "success", "complete": True, "stored_files": names_}))
    from airflow_provider_horovod import store

    calls = [0]
    real = view_store._relative_ok
    monkeypatch.setattr(view_store, "_relative_ok", lambda rel: calls.__setitem__(0, calls[0] + 1) or real(rel))
    one_try = view_store.Try(1, store.storage_path(str(folder)), store.read_marker(store.storage_path(str(folder))))
    assert len(one_try.files()) == 2000
    assert calls[0] <= 2 * len(names_)  # linear in the files: each name checked once, not once per file
    assert Path(str(one_try.file("checkpoints/f-0007.pt").path)).read_bytes() == b"x"
