"""``resume=<uri>`` copies only a folder inside the artifact root (or a root the operator allows
with ``[horovod] resume_extra_roots``) to the executors: an asset event's extra naming the Airflow
home, a link out of the root or a look-alike root is refused before anything is copied. Finding
N15 of issue #21."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

from airflow_provider_horovod import store
from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator
from airflow_provider_horovod.recorder import TryRecorder
from airflow_provider_horovod.runner.records import RUN_MARKER as ENGINE_MARKER


def _resume(op: HorovodRunnerOperator, folder) -> str:
    """What the operator would ship to every executor as ``runtime.resume_dir()``."""
    _source, local = _resume_from(op, folder, {"ti": types.SimpleNamespace(try_number=1)})
    return local


def _resume_from(op: HorovodRunnerOperator, folder, context: dict):
    """The operator's resume step, as its ``TryRecorder`` takes it for the try in ``folder``."""
    return TryRecorder(folder, context, op._try_settings(), hook=op.hook, log=op.log).resume_source()


def _operator(root: Path, resume: str) -> HorovodRunnerOperator:
    return HorovodRunnerOperator(task_id="retrain", training_callable="airflow_provider_horovod.runtime:size",
                                 artifact_root=str(root), resume=resume)


@pytest.fixture
def layout(tmp_path):
    """An artifact root with one committed try, and an Airflow home beside it."""
    root, home = tmp_path / "artifacts", tmp_path / "airflow"
    local = tmp_path / "local"
    (local / "checkpoints").mkdir(parents=True)
    (local / "checkpoints" / "model.pt").write_bytes(b"weights")
    (local / ENGINE_MARKER).write_text(json.dumps({"status": "success", "complete": True}))
    committed = store.prepare_try(str(root), dag_id="train", run_id="r1", task_id="train", try_number=1)
    store.store_try(local, committed, store.TryMarker(status=store.TryStatus.SUCCESS, complete=False, try_number=1))
    home.mkdir()
    (home / "airflow.cfg").write_text("[core]\nfernet_key = the-key\n")
    return types.SimpleNamespace(root=root, home=home, committed=committed, tmp=tmp_path)


@pytest.mark.parametrize("outside", ["home", "link", "look-alike"])
def test_resume_outside_the_artifact_root_is_refused_before_anything_is_copied(layout, outside):
    if outside == "link":
        (layout.root / "evil").symlink_to(layout.home)
        uri = str(layout.root / "evil")
    elif outside == "look-alike":
        shutil.copytree(layout.home, layout.tmp / "artifacts-old")
        uri = str(layout.tmp / "artifacts-old")
    else:
        uri = "file://%s" % layout.home  # the review: an asset event's checkpoint_uri naming AIRFLOW_HOME
    op = _operator(layout.root, uri)
    folder = store.prepare_try(str(layout.root), dag_id="retrain", run_id="r", task_id="retrain", try_number=1)
    with pytest.raises(ArtifactError, match="outside the artifact root.*resume_extra_roots"):
        shutil.rmtree(_resume(op, folder))  # (without the check: a copy of airflow.cfg, bound for every executor)


def test_resume_inside_the_root_or_an_allowed_root_still_works(layout, monkeypatch):
    folder = store.prepare_try(str(layout.root), dag_id="retrain", run_id="r", task_id="retrain", try_number=1)
    local = _resume(_operator(layout.root, str(layout.committed)), folder)
    assert (Path(local) / "model.pt").read_bytes() == b"weights"
    shutil.rmtree(local)
    monkeypatch.setenv("AIRFLOW__HOROVOD__RESUME_EXTRA_ROOTS", "s3://other/x, file://%s" % layout.home)
    local = _resume(_operator(layout.root, str(layout.home)), folder)
    assert (Path(local) / "airflow.cfg").exists()  # the operator allowed that root on purpose
    shutil.rmtree(local)


@pytest.mark.parametrize("uri, root, inside", [
    ("s3://aws_default@bucket/horovod/d/r/t/try-1", "s3://aws_default@bucket/horovod", True),
    ("s3://aws_default@bucket/horovod/../secrets", "s3://aws_default@bucket/horovod", False),
    ("s3://other_conn@bucket/horovod/d", "s3://aws_default@bucket/horovod", False),
    ("gs://bucket/horovod/d", "s3://bucket/horovod", False),
    ("s3://bucket/horovod-old/d", "s3://bucket/horovod", False),
])
def test_an_object_store_resume_uri_counts_as_inside_only_under_the_same_root_and_connection(uri, root, inside):
    assert store.is_inside(store.storage_path(uri), store.storage_path(root)) is inside


@pytest.mark.parametrize("forged", ["another task's version", "a worker's own folder", "this task's folder, no try"])
def test_a_task_state_store_record_naming_anything_but_this_task_instances_tries_is_refused(layout, forged, caplog):
    """T4-2 of issue #40: resume="auto" trusted task_state_store's record, which a user with PUT on
    the task instance writes; now it must lie in this task instance's own try folders."""
    other = store.prepare_try(str(layout.root), dag_id="other-team", run_id="r", task_id="train", try_number=1)
    version = store.Version(seq=1, step=9, time=0.0, size=7, files=(("model.pt", 7),))
    (layout.tmp / "v").mkdir()
    (layout.tmp / "v" / "model.pt").write_bytes(b"theirs!")
    theirs = store.commit_version(other, layout.tmp / "v", version, keep=1)
    (layout.home / store.VERSION_MARKER).write_text(json.dumps(version.to_json()))  # "committed", to the check
    mine = store.prepare_try(str(layout.root), dag_id="retrain", run_id="r", task_id="retrain", try_number=2)
    (mine.parent / store.VERSION_MARKER).write_text(json.dumps(version.to_json()))
    uri = {"another task's version": str(theirs), "a worker's own folder": str(layout.home),
           "this task's folder, no try": str(mine.parent)}[forged]
    state = StateStore({store.STATE_KEY: {"uri": uri, "try_number": 1, "step": 9, "seq": 1}})
    op = HorovodRunnerOperator(task_id="retrain", training_callable="airflow_provider_horovod.runtime:size",
                               artifact_root=str(layout.root))
    source, local = _resume_from(op, mine, {"ti": types.SimpleNamespace(try_number=2), "task_state_store": state})
    assert (source, local) == (None, None)  # this task's try 1 committed nothing: from scratch, nothing copied
    assert "not in this task instance's tries" in caplog.text


def test_a_record_of_this_task_instances_own_version_still_resumes(layout):
    first = store.prepare_try(str(layout.root), dag_id="retrain", run_id="r", task_id="retrain", try_number=1)
    (layout.tmp / "v").mkdir()
    (layout.tmp / "v" / "model.pt").write_bytes(b"mine")
    path = store.commit_version(first, layout.tmp / "v", store.Version(seq=1, step=3, time=0.0, size=4,
                                                                       files=(("model.pt", 4),)), keep=1)
    mine = store.prepare_try(str(layout.root), dag_id="retrain", run_id="r", task_id="retrain", try_number=2)
    state = StateStore({store.STATE_KEY: {"uri": str(path), "try_number": 1, "step": 3, "seq": 1}})
    op = HorovodRunnerOperator(task_id="retrain", training_callable="airflow_provider_horovod.runtime:size",
                               artifact_root=str(layout.root))
    source, local = _resume_from(op, mine, {"ti": types.SimpleNamespace(try_number=2), "task_state_store": state})
    try:
        assert (source.try_number, source.step) == (1, 3) and (Path(local) / "model.pt").read_bytes() == b"mine"
    finally:
        shutil.rmtree(local)


class StateStore:
    """Airflow 3.3's task_state_store as the operator sees it."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value, retention=None):
        self.values[key] = value

