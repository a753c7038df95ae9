"""The operator's resume step (which checkpoint a try starts from) and its store steps (each version
as it comes, the try's end), taken by its ``TryRecorder`` with the operator's own settings, on a real
local artifact store: no Spark, no ranks."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import cloudpickle

from airflow_provider_horovod import store
from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator
from airflow_provider_horovod.recorder import TryRecorder
from airflow_provider_horovod.runner.driver.artifact_dir import commit
from airflow_provider_horovod.runner.events import RunReport, RunStatus
from airflow_provider_horovod.runner.records import Version


def train():
    return 1


class StateStore:
    """Airflow 3.3's ``task_state_store`` accessor, as the operator sees it: ``get`` and ``set``."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def get(self, key: str, default: object = None) -> object:
        return self.values.get(key, default)

    def set(self, key: str, value: object, **_: object) -> None:
        self.values[key] = json.loads(json.dumps(value))  # JSON values only, as Airflow stores them


def operator(root: Path, **kwargs) -> HorovodRunnerOperator:
    return HorovodRunnerOperator(task_id="train", training_callable=train, np=2, artifact_root=str(root), **kwargs)


def context(try_number: int, state: StateStore | None = None, max_tries: int | None = None) -> dict:
    return {"ti": SimpleNamespace(try_number=try_number, max_tries=max_tries), "task_state_store": state}


def recorder(op: HorovodRunnerOperator, folder, ctx: dict) -> TryRecorder:
    """The operator's recorder of the try in ``folder``, as ``execute`` opens it (its settings, hook and log)."""
    return TryRecorder(folder, ctx, op._try_settings(), hook=op.hook, log=op.log)


def resume_from(op: HorovodRunnerOperator, folder, ctx: dict):
    """The checkpoint the try in ``folder`` resumes from, and its local copy."""
    return recorder(op, folder, ctx).resume_source()


def try_folder(root: Path, try_number: int):
    return store.prepare_try(str(root), dag_id="d", run_id="r", task_id="train", try_number=try_number)


def local_version(tmp_path: Path, seq: int, step: int) -> tuple[Path, Version]:
    folder = tmp_path / ("local-%d" % seq)
    folder.mkdir()
    (folder / "model.pt").write_text("weights at step %d" % step)
    version = Version(seq=seq, step=step, time=time.time(), size=len("weights at step %d" % step),
                      files=(("model.pt", len("weights at step %d" % step)),))
    return folder, version


def stored(op: HorovodRunnerOperator, folder, ctx: dict, *versions: tuple[Version, Path]) -> list[dict]:
    """Each version offered to the operator's sink as the engine does, then the try's end (all uploaded)."""
    staging = Path(tempfile.mkdtemp(prefix="hvd-test-uploads-"))
    uploads = recorder(op, folder, ctx).version_sink(staging)
    for version, local in versions:
        uploads(version, local)
    try:
        return uploads.close(30)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def test_the_version_sink_commits_each_version_into_the_store_and_records_it_for_the_next_try(tmp_path,
                                                                                             artifact_root):
    root, state = artifact_root, StateStore()
    op, folder = operator(root, keep_checkpoints=1), try_folder(root, 1)
    offered = []
    for seq, step in ((1, 10), (2, 20), (3, 30)):
        folder_, version = local_version(tmp_path, seq, step)
        offered.append((version, folder_))
    not_stored = stored(op, folder, context(1, state), *offered)
    assert {n["seq"] for n in not_stored} <= {1, 2} and all("coalesced" in n["reason"] for n in not_stored)
    assert [(v.seq, v.step) for v, _ in store.versions(folder)] == [(3, 30)]  # keep_checkpoints=1 pruned the rest
    recorded = state.values[store.STATE_KEY]
    assert (recorded["seq"], recorded["step"], recorded["try_number"]) == (3, 30, 1)
    assert (store.storage_path(recorded["uri"]) / "model.pt").read_text() == "weights at step 30"


def test_a_slow_store_coalesces_to_the_newest_version_and_the_try_end_says_what_did_not_make_it(tmp_path,
                                                                                                artifact_root):
    root = artifact_root
    op, folder = operator(root, keep_checkpoints=5), try_folder(root, 1)
    uploads = recorder(op, folder, context(1, StateStore())).version_sink(tmp_path / "uploads")
    big = tmp_path / "big"
    big.mkdir()
    (big / "model.pt").write_bytes(bytes(64 << 20))  # the first upload takes a while: the next ones wait
    later = [local_version(tmp_path, seq, seq) for seq in range(2, 6)]
    uploads(Version(seq=1, step=1, time=1.0, size=64 << 20, files=(("model.pt", 64 << 20),)), big)
    deadline = time.monotonic() + 10
    while uploads.uploading != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    for folder_, version in later:  # offered while the first one uploads: each returns at once
        uploads(version, folder_)
    not_stored = uploads.close(60)
    kept = [v.seq for v, _ in store.versions(folder)]
    assert kept[-1] == 5 and 1 in kept  # the newest, and the one that was uploading
    assert sorted(n["seq"] for n in not_stored) == sorted(set(range(2, 5)) - set(kept))  # the rest coalesced ...
    if artifact_root.startswith("s3://"):  # 64 MiB to S3 takes far longer than four offers: never queued
        assert [n["seq"] for n in not_stored] == [2, 3, 4]
    assert all("coalesced" in n["reason"] for n in not_stored)  # ... and said so
    assert not any((tmp_path / "uploads").iterdir())  # the staged copies are gone


def test_a_retry_resumes_from_what_task_state_store_recorded_copied_to_a_local_folder(tmp_path):
    root, state = tmp_path / "root", StateStore()
    op, first = operator(root), try_folder(root, 1)
    local_folder, version = local_version(tmp_path, 1, 10)
    stored(op, first, context(1, state), (version, local_folder))
    source, local = resume_from(op, try_folder(root, 2), context(2, state))
    assert (source.try_number, source.step, source.seq) == (1, 10, 1)
    assert (Path(local) / "model.pt").read_text() == "weights at step 10"


def test_without_a_record_the_store_scan_finds_the_newest_version_of_the_newest_earlier_try(tmp_path):
    root = tmp_path / "root"
    op = operator(root)
    for try_number, step in ((1, 5), (2, 7)):
        scratch = tmp_path / ("try-%d" % try_number)
        scratch.mkdir()
        folder, version = local_version(scratch, 1, step)
        stored(op, try_folder(root, try_number), context(try_number), (version, folder))
    source, local = resume_from(op, try_folder(root, 3), context(3, StateStore()))
    assert (source.try_number, source.step) == (2, 7)
    assert (Path(local) / "model.pt").read_text() == "weights at step 7"


def test_a_first_try_and_resume_never_start_from_scratch(tmp_path):
    root, state = tmp_path / "root", StateStore()
    local_folder, version = local_version(tmp_path, 1, 1)
    first = try_folder(root, 1)
    stored(operator(root), first, context(1, state), (version, local_folder))
    assert resume_from(operator(root), first, context(1, state)) == (None, None)  # a first try has nothing earlier
    assert resume_from(operator(root, resume="never"), try_folder(root, 3), context(3, state)) == (None, None)


def test_a_try_after_a_clear_starts_from_scratch_and_its_retries_resume_only_from_tries_since_the_clear(tmp_path):
    root, state = tmp_path / "root", StateStore()
    local_folder, version = local_version(tmp_path, 1, 5)
    stored(operator(root, retries=2), try_folder(root, 1), context(1, state, max_tries=2), (version, local_folder))
    # Clear after try 1: Airflow sets max_tries to 1 + retries, so try 2 is the first of a new round
    assert resume_from(operator(root, retries=2), try_folder(root, 2), context(2, state, max_tries=3)) == (None, None)
    # its retry (try 3) resumes from what try 2 committed, never from before the Clear
    assert resume_from(operator(root, retries=2), try_folder(root, 3), context(3, state, max_tries=3)) == (None, None)
    local_folder, version = local_version(tmp_path, 2, 9)
    stored(operator(root, retries=2), try_folder(root, 2), context(2, state, max_tries=3), (version, local_folder))
    source, _ = resume_from(operator(root, retries=2), try_folder(root, 3), context(3, state, max_tries=3))
    assert (source.try_number, source.step) == (2, 9)


def test_with_resume_on_clear_a_try_after_a_clear_resumes_as_a_retry_does(tmp_path):
    root, state = tmp_path / "root", StateStore()
    local_folder, version = local_version(tmp_path, 1, 5)
    op = operator(root, retries=0, resume_on_clear=True)
    stored(op, try_folder(root, 1), context(1, state, max_tries=0), (version, local_folder))
    source, _ = resume_from(op, try_folder(root, 2), context(2, state, max_tries=1))  # cleared: max_tries 1 + 0
    assert (source.try_number, source.step) == (1, 5)
    source, _ = resume_from(op, try_folder(root, 2), context(2, None, max_tries=1))  # Airflow 3.4: the store emptied
    assert source.try_number == 1  # the store scan finds it


def test_the_first_try_since_a_clear_is_airflows_own_arithmetic():
    from airflow_provider_horovod.recorder import first_try_since_clear

    def first(try_number, max_tries, retries):
        return first_try_since_clear(SimpleNamespace(try_number=try_number, max_tries=max_tries), retries)

    assert [first(n, 2, 2) for n in (1, 2, 3)] == [1, 1, 1]  # never cleared: try 1 and its retries
    assert [first(4, 5, 2), first(5, 5, 2)] == [4, 4]  # cleared after try 3
    assert first(2, 1, 0) == 2  # no retries, cleared after try 1
    assert first(3, None, 2) == first(3, -1, 2) == 1  # not known: every earlier try counts


def test_the_try_store_keeps_a_result_that_is_not_json_beside_the_artifacts_and_says_where(tmp_path):
    root, local, staging = tmp_path / "root", tmp_path / "engine", tmp_path / "engine" / ".incoming"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints" / "final.pt").write_text("final")
    commit(local, staging, status="success", complete=True, run_id="abc", received=[])  # the engine's end
    folder = try_folder(root, 1)
    report = RunReport(run_id="abc", np=2, launcher="torch", status=RunStatus.SUCCESS, duration_s=1.5)
    xcom = recorder(operator(root, launcher="torch"), folder, context(1)).store_try(
        str(local), {1, 2}, report, store.TryStatus.SUCCESS, None)
    assert xcom["result"]["type"] == "builtins.set" and xcom["launcher"] == "torch"
    assert cloudpickle.loads(store.storage_path(xcom["result"]["artifact_uri"]).read_bytes()) == {1, 2}
    assert store.storage_path(xcom["checkpoint_uri"]).name == "checkpoints"
    marker = store.read_marker(folder)
    assert marker.complete and marker.status == store.TryStatus.SUCCESS
    assert marker.launcher == "torch" and "checkpoints/final.pt" in marker.stored_files
