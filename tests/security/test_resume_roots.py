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
from airflow_provider_horovod.runner.records import RUN_MARKER as ENGINE_MARKER


def _resume(op: HorovodRunnerOperator, folder) -> str:
    """What the operator would ship to every executor as ``runtime.resume_dir()``."""
    _source, local = op._resume_from(folder, {"ti": types.SimpleNamespace(try_number=1)})
    return local


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
