"""A try's life in the store (``recorder.TryRecorder``), alone: opened, fed the engine's versions and
reports, recorded at the run's end, then read by the next try, on a real ``file://`` store in a
temporary folder. No operator, no Spark, no ranks."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_horovod import retry, store
from airflow_provider_horovod.exceptions import HorovodRunError
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
from airflow_provider_horovod.recorder import TryRecorder, TrySettings
from airflow_provider_horovod.runner.driver.artifact_dir import commit
from airflow_provider_horovod.runner.events import RunReport, RunStatus
from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.records import Version

log = logging.getLogger("test_recorder")


class StateStore:
    """Airflow 3.3's ``task_state_store`` accessor: ``get`` and ``set`` of JSON values."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def get(self, key: str, default: object = None) -> object:
        return self.values.get(key, default)

    def set(self, key: str, value: object, **_: object) -> None:
        self.values[key] = json.loads(json.dumps(value))


def context(try_number: int, state: StateStore | None) -> dict:
    ti = SimpleNamespace(dag_id="d", run_id="r", task_id="train", map_index=-1, try_number=try_number, max_tries=2)
    return {"ti": ti, "task_state_store": state}


def open_try(root: Path, try_number: int, state: StateStore | None, **settings) -> TryRecorder:
    settings = TrySettings(**{"artifact_root": "file://%s" % root, "retries": 2, **settings})
    return TryRecorder.open(context(try_number, state), settings, hook=HorovodRunnerHook(), log=log)


def engine_version(tmp_path: Path, seq: int, step: int) -> tuple[Version, Path]:
    """A version as the engine commits it in its local staging."""
    folder = tmp_path / ("engine-v%d" % seq)
    folder.mkdir()
    data = b"weights at step %d" % step
    (folder / "model.pt").write_bytes(data)
    return Version(seq=seq, step=step, time=time.time(), size=len(data), files=(("model.pt", len(data)),)), folder


def engine_end(local: str, run_id: str, *, checkpoint: bytes | None) -> None:
    """The engine's committed artifact folder at the run's end (rank 0's checkpoints/, its marker last)."""
    incoming = Path(local) / ".incoming"
    (incoming / "checkpoints").mkdir(parents=True)
    if checkpoint is not None:
        (incoming / "checkpoints" / "model.pt").write_bytes(checkpoint)
    commit(Path(local), incoming, status="success", complete=True, run_id=run_id, received=[])


def test_a_try_opened_fed_and_recorded_leaves_a_complete_try_that_the_next_try_resumes_from(tmp_path):
    root, state = tmp_path / "root", StateStore()
    first = open_try(root, 1, state)
    assert str(first.folder) == "file://%s/d/r/train/try-1" % root
    assert (first.source, first.resume_from) == (None, None)  # a first try has nothing earlier
    with first.staging() as local:
        on_checkpoint, on_report = first.sinks()
        on_checkpoint(*engine_version(tmp_path, 1, 10))
        on_report(Report(time=time.time(), step=10, total_steps=20, metrics={"loss": 0.5}))
        engine_end(local, "run-1", checkpoint=b"final weights")
        report = RunReport(run_id="run-1", np=2, launcher="gloo", status=RunStatus.SUCCESS, duration_s=3.0)
        xcom, status = first.record({"accuracy": 0.9}, report, None)
    assert status == store.TryStatus.SUCCESS
    assert xcom["result"] == {"accuracy": 0.9} and xcom["metrics"] == {"loss": 0.5, "step": 10, "total_steps": 20}
    assert xcom["checkpoint_uri"] == str(first.folder / "checkpoints") and xcom["try_number"] == 1
    assert [v.seq for v, _ in store.versions(first.folder)] == [1]  # uploaded while the run went on
    assert state.values[store.STATE_KEY]["seq"] == 1  # ... and recorded for the next try
    marker = store.read_marker(first.folder)
    assert marker.complete and marker.status == store.TryStatus.SUCCESS and marker.not_stored == ()
    assert [row["step"] for row in store.read_metrics(first.folder, max_rows=10)] == [10]

    first.record_final_checkpoint()  # the try's checkpoints/ is newer than its last version
    assert state.values[store.STATE_KEY]["seq"] is None
    second = open_try(root, 2, state)
    assert second.source.path == first.folder / "checkpoints" and second.source.try_number == 1
    copy = Path(second.resume_from)
    assert (copy / "model.pt").read_bytes() == b"final weights"
    with second.staging():
        pass
    assert not copy.exists() and second.resume_from is None  # the local copy goes with the try's staging


def test_the_resume_copy_goes_with_the_staging_whatever_ends_the_try(tmp_path):
    """The operator enters ``staging`` before it builds the SparkSession: a Spark that never starts
    (or anything else that ends the try early) leaves no ``hvdresume-*`` copy behind."""
    root, state = tmp_path / "root", StateStore()
    first = open_try(root, 1, state)
    on_checkpoint = first.version_sink(tmp_path / "staging")
    on_checkpoint(*engine_version(tmp_path, 1, 10))
    assert on_checkpoint.close(30) == []
    second = open_try(root, 2, state)
    copy = Path(second.resume_from)
    assert (copy / "model.pt").read_bytes() == b"weights at step 10"
    with pytest.raises(RuntimeError, match="no Spark"), second.staging():
        raise RuntimeError("no Spark")
    assert not copy.exists() and second.resume_from is None  # on main's code: left in the temp folder


def test_a_failed_run_is_stored_with_its_failure_and_what_the_retry_policy_makes_of_it(tmp_path, caplog):
    try1 = open_try(tmp_path / "root", 1, None, retry_policy=retry.HorovodRetryPolicy())
    error = HorovodRunError("Rank 1 raised ValueError: boom\nthe traceback")
    with caplog.at_level(logging.INFO, logger=log.name), try1.staging() as local:
        try1.sinks()
        engine_end(local, "run-1", checkpoint=None)
        report = RunReport(run_id="run-1", np=2, launcher="gloo", status=RunStatus.FAILED)
        xcom, status = try1.record(None, report, error)
    assert status == store.TryStatus.FAILED and xcom["result"] is None and xcom["checkpoint_uri"] is None
    marker = store.read_marker(try1.folder)
    assert marker.error["message"] == "Rank 1 raised ValueError: boom"
    assert marker.error["retry"].startswith("Not retried") and marker.error["retry"] in caplog.text
    assert error.failure["message"] == "Rank 1 raised ValueError: boom"  # the policy reads it from the exception


def test_a_version_the_store_did_not_take_is_logged_and_named_in_the_tries_marker(tmp_path, caplog):
    try1 = open_try(tmp_path / "root", 1, StateStore())
    store._put_bytes(try1.folder / "versions", b"not a folder")  # every version's upload fails
    with caplog.at_level(logging.INFO, logger=log.name), try1.staging() as local:
        on_checkpoint, _ = try1.sinks()
        on_checkpoint(*engine_version(tmp_path, 1, 10))
        engine_end(local, "run-1", checkpoint=b"final")
        xcom, _ = try1.record(1, RunReport(run_id="run-1", np=2, launcher="gloo", status=RunStatus.SUCCESS), None)
    marker = store.read_marker(try1.folder)
    assert [item["seq"] for item in marker.not_stored] == [1]
    assert "Cannot commit checkpoint version 1" in marker.not_stored[0]["reason"]
    assert "Checkpoint version 1 was not stored in %s" % try1.folder in caplog.text


def test_a_try_left_by_an_exception_it_does_not_store_ends_its_upload_thread_without_waiting(tmp_path):
    """``_train`` re-raises what the engine did not end as cancelled (a KeyboardInterrupt, a SystemExit):
    ``record`` never runs, and the upload thread must not outlive the staging it uploads from."""
    try1 = open_try(tmp_path / "root", 1, StateStore())
    with pytest.raises(KeyboardInterrupt), try1.staging():
        on_checkpoint, _ = try1.sinks()
        on_checkpoint(*engine_version(tmp_path, 1, 10))
        raise KeyboardInterrupt
    uploads = try1._uploads
    uploads._thread.join(10)
    assert uploads.closed and not uploads._thread.is_alive()  # on main's code: alive, waiting forever


@pytest.mark.parametrize("resume", ["never", ""])
def test_a_try_that_may_not_resume_opens_without_a_source_even_with_a_recorded_checkpoint(tmp_path, resume):
    root, state = tmp_path / "root", StateStore()
    first = open_try(root, 1, state)
    on_checkpoint = first.version_sink(tmp_path / "staging")
    on_checkpoint(*engine_version(tmp_path, 1, 10))
    assert on_checkpoint.close(30) == [] and store.STATE_KEY in state.values
    later = open_try(root, 2, state, resume=resume)
    assert (later.source, later.resume_from) == (None, None)


def test_a_try_removes_the_staging_and_resume_copies_that_a_killed_try_on_this_machine_left(tmp_path, monkeypatch):
    """A try killed with SIGKILL (OOM, a zombie's end) cannot remove its staged versions or its resume
    copy, each as large as a checkpoint: the next try on the machine does."""
    import subprocess
    import tempfile

    from airflow_provider_horovod.runner import names

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for prefix in (names.STAGING_DIR_PREFIX, names.RESUME_DIR_PREFIX):
        (temp / (prefix % dead.pid + "left")).mkdir()
        (temp / (prefix % dead.pid + "left") / "model.pt").write_bytes(b"big weights")
    alive = temp / (names.STAGING_DIR_PREFIX % os.getpid() + "running")  # another try of this process: kept
    alive.mkdir()
    try1 = open_try(tmp_path / "root", 1, StateStore())
    with try1.staging() as local:
        assert Path(local).name.startswith(names.STAGING_DIR_PREFIX % os.getpid())
        assert sorted(p.name for p in temp.iterdir() if p.name != Path(local).name and p != Path(try1._scratch)) == [
            alive.name]  # on main's code: both copies of the dead try were still there
