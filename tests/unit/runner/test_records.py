"""The saved records: each written with its schema, read back whole, and files written before
schemas (as main wrote them until 2026-12-05) still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner import names, records
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.messages import PutVersion, Report
from airflow_provider_horovod.runner.records import (
    CommitRequest,
    Layout,
    MetricsRow,
    RunMarker,
    TryMarker,
    TryStatus,
    Version,
)
from airflow_provider_horovod.runner.driver.versions import VersionSink

# A try marker exactly as main's store wrote it before schemas: the engine's _RUN.json with the
# operator's keys merged over it, and the stored files.
MARKER_BEFORE_SCHEMAS = {
    "status": "failed", "complete": True, "run_id": "6f1c", "files": [{"path": "checkpoints/epoch-1.pt", "size": 3}],
    "committed_at": 1796500000.5, "checkpoint": "checkpoints", "timeline": "timeline.json",
    "timeline_summary": "timeline_summary.json", "timeline_picture": "timeline.svg", "np": 2, "launcher": "gloo",
    "try_number": 1, "duration_s": 12.5, "resumed_from": None, "resumed_from_try": None, "resumed_from_step": None,
    "error": {"message": "boom", "rank": 1}, "stored_files": ["checkpoints/epoch-1.pt", "timeline.json"],
}


@pytest.mark.parametrize("record", [
    Version(seq=3, step=40, time=1.5, size=9, files=(("model.pt", 9),), sent=("model.pt",), metrics={"loss": 0.5}),
    CommitRequest(time=2.0, step=7, metrics={"loss": 0.25}),
    MetricsRow(time=3.0, step=1, total_steps=10, values={"acc": 0.9}),
    RunMarker(status="success", complete=True, run_id="r", files=({"path": "a", "size": 1},), committed_at=4.0,
              checkpoint="checkpoints", timeline={"timeline": "timeline.json"}, np=2, launcher="torch"),
    TryMarker(status=TryStatus.CANCELLED, complete=False, stored_files=("a",), try_number=2, np=-2, launcher="mpirun",
              error={"message": "cancelled"}, attempts=({"number": 0, "ending": "lost"}, {"number": 1, "ending": "cancelled"}),
              run=RunMarker(status="cancelled", complete=False, staging=".incoming-1")),
])
def test_every_record_is_written_with_its_schema_and_reads_back_whole(record):
    saved = json.loads(json.dumps(record.to_json()))
    assert saved["schema"] == records.SCHEMA
    assert type(record).from_json(saved) == record


def test_a_try_marker_written_before_schemas_reads_as_its_two_parts():
    marker = TryMarker.from_json(MARKER_BEFORE_SCHEMAS)
    assert (marker.status, marker.complete, marker.try_number, marker.np, marker.launcher) == (
        TryStatus.FAILED, True, 1, 2, "gloo")
    assert marker.stored_files == ("checkpoints/epoch-1.pt", "timeline.json") and marker.error["rank"] == 1
    assert marker.run.run_id == "6f1c" and marker.run.checkpoint == "checkpoints"
    assert marker.run.timeline == {"timeline": "timeline.json", "timeline_summary": "timeline_summary.json",
                                   "timeline_picture": "timeline.svg"}
    rewritten = marker.to_json()  # what the store writes now: the engine's part whole under "run"
    assert rewritten["schema"] == 1 and rewritten["run"]["run_id"] == "6f1c" and "files" not in rewritten
    assert TryMarker.from_json(rewritten) == marker


def test_records_written_before_schemas_and_by_a_newer_schema_read_for_the_fields_known():
    version = {"seq": 1, "step": None, "time": 1.0, "size": 0, "files": [], "sent": [], "metrics": {}}
    assert Version.from_json(version).seq == 1  # schema 0
    assert Version.from_json({**version, "schema": 2, "added_later": True}).seq == 1
    assert MetricsRow.from_line('{"step": 4, "time": 2.0, "values": {"loss": 1}}') == MetricsRow(2.0, 4, None, {"loss": 1})
    assert CommitRequest.from_json({"step": 3, "metrics": {}, "time": 1.0}) == CommitRequest(1.0, 3, {})
    with pytest.raises(ValueError, match="schema"):
        Version.from_json({**version, "schema": "1"})


@pytest.mark.parametrize("line", ['{"step": 1, "ti', "[1, 2]", '{"step": 1, "time": 1}', '{"values": {}, "schema": -1}'])
def test_a_line_that_is_not_a_metrics_row_is_none(line):
    assert MetricsRow.from_line(line) is None


def test_one_predicate_and_one_reader_say_which_versions_a_folder_holds(tmp_path):
    layout = Layout(tmp_path)
    for seq in (2, 1, 3):
        layout.version(seq).mkdir(parents=True)
        (layout.version(seq) / records.VERSION_MARKER).write_text(json.dumps(
            Version(seq=seq, step=seq, time=0.0, size=0, files=()).to_json()))
    (layout.versions / ".000004.partial").mkdir()  # being built
    (layout.versions / "000005").mkdir()  # no marker yet
    (layout.versions / "00006").mkdir()  # not a version's name
    (layout.version(7)).mkdir()
    (layout.version(7) / records.VERSION_MARKER).write_text('{"seq": 7, "ti')  # half a marker
    assert [v.seq for v, _ in layout.committed_versions()] == [1, 2, 3]
    assert [records.is_version_folder(n) for n in ("000001", "1234567", ".000004.partial", "00006", "00000a")] == [
        True, True, False, False, False]


@pytest.mark.parametrize(("step", "metrics", "error"), [
    (-1, {}, TypeError), ("3", {}, TypeError), (True, {}, TypeError),
    (1, {"loss": "low"}, TypeError), (1, {"loss": float("nan")}, ValueError), (1, {"host": "worker-1"}, TypeError),
])
def test_commit_checkpoint_checks_step_and_metrics_at_the_call_by_reports_rules(step, metrics, error, tmp_path, monkeypatch):
    with pytest.raises(error):
        Report.make(0.0, step, None, metrics)  # report()'s rules ...
    with pytest.raises(error):
        runtime.commit_checkpoint(step, **metrics)  # ... outside a run
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    monkeypatch.setenv(names.ENV_RANK, "0")
    (runtime.checkpoint_dir() / "model.pt").write_bytes(b"w")
    with pytest.raises(error):
        runtime.commit_checkpoint(step, **metrics)  # ... and in rank 0, before anything is snapshot
    assert not (tmp_path / names.COMMITS_DIR).exists()


def test_rank_0_snapshot_carries_its_commit_request(tmp_path, monkeypatch):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    monkeypatch.setenv(names.ENV_RANK, "0")
    (runtime.checkpoint_dir() / "model.pt").write_bytes(b"w")
    runtime.commit_checkpoint(step=5, loss=0.5)
    (snapshot,) = (tmp_path / names.COMMITS_DIR).iterdir()
    request = CommitRequest.from_json(json.loads((snapshot / CommitRequest.FILE).read_text()))
    assert (request.step, request.metrics) == (5, {"loss": 0.5})
    assert (snapshot / "model.pt").read_bytes() == b"w"


def test_the_driver_refuses_a_version_whose_metrics_break_reports_rules(tmp_path):
    """A rank that sends its own frames gets no further than commit_checkpoint's check."""
    sink = VersionSink(tmp_path, keep=2, limits=Limits())
    (sink.fresh_staging() / "model.pt").write_bytes(b"w")
    why = sink.commit(PutVersion(step=1, metrics={"host": "x" * 70000}, manifest={"model.pt": 1}), ["model.pt"])
    assert "takes" in why or "number" in why
    assert not Layout(Path(tmp_path)).committed_versions() and sink.committed == []
