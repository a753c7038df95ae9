"""Findings T4-6, T4-7, T4-8, T4-10 and T4-13 of issue #40: what rank 0 writes or sends (a report, a
file in its checkpoint folder or beside it, a timeline) cannot stop the try's final store, replace
the driver's own files, reach another task's versions through the view, or cost the API server
more than a bounded amount per request."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from airflow_provider_horovod import runtime, store
from airflow_provider_horovod.metrics import MetricsRecorder, duration_text
from airflow_provider_horovod.plugins import store as view_store
from airflow_provider_horovod.plugins import view
from airflow_provider_horovod.runner import records
from airflow_provider_horovod.runner.driver.artifact_dir import commit
from airflow_provider_horovod.runner.messages import MAX_TIME, PutVersion, Report
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.driver.versions import VersionSink
from airflow_provider_horovod.runner.wire import ProtocolError


# -- T4-6: no report stops the final store -----------------------------------------------------------
def test_a_step_too_large_for_any_reader_is_refused_at_the_call_and_on_the_channel():
    with pytest.raises(ValueError, match="at most 2\\*\\*63 - 1"):
        runtime.report(step=10**399)
    with pytest.raises(ProtocolError):
        Report.from_json({"time": 1.0, "step": 10**399, "metrics": {}})
    with pytest.raises(ProtocolError):
        Report.from_json({"time": float("nan"), "step": 1, "metrics": {}})  # json.loads reads NaN


def test_the_recorder_closes_whatever_reports_reached_it(tmp_path, caplog):
    """Reports made without the checks (a rank's own frames, an older rank) still end in the final
    values: close() never raises, so the operator's store that follows always runs."""
    recorder = MetricsRecorder(tmp_path / "metrics.jsonl", commit=lambda data, base: None,
                               log=__import__("logging").getLogger("test"), progress_interval=3600)
    recorder(Report(time=1.0, step=1, total_steps=2**70, metrics={"loss": 1.0}))
    recorder(Report(time=2.0, step=10**399, total_steps=2**70, metrics={"loss": 0.5}))
    assert recorder.close()["loss"] == 0.5


def test_the_metrics_history_stays_within_its_bound_spread_over_the_whole_try(tmp_path, monkeypatch):
    """T4-3's store half: however long rank 0 reports, metrics.jsonl stays within MAX_BYTES."""
    import airflow_provider_horovod.metrics as metrics

    monkeypatch.setattr(metrics, "MAX_BYTES", 8192)
    local = tmp_path / "metrics.jsonl"
    recorder = MetricsRecorder(local, commit=lambda data, base: None, log=__import__("logging").getLogger("test"))
    for step in range(20000):
        recorder(Report(time=float(step), step=step, metrics={"loss": 1.0 / (step + 1)}))
    recorder.close()
    rows = [json.loads(line) for line in local.read_text().splitlines()]
    assert local.stat().st_size <= 8192 + 200
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 19999 and len(rows) > 40
    gaps = {b["step"] - a["step"] for a, b in zip(rows[:-2], rows[1:-1])}
    assert len(gaps) <= 2  # evenly thinned (the stride doubled as the file filled), not cut off


def test_report_times_outside_the_calendar_are_refused_at_the_call_and_on_the_channel():
    """Issue 49 (T4-6 again): -1e308 then 1e308 were finite, so accepted, and 2e308 apart."""
    for when in (-1e308, 1e308, -1.0, MAX_TIME * 2):
        with pytest.raises(ValueError, match="seconds since the epoch"):
            Report.make(when, 1, None, {})
        with pytest.raises(ProtocolError):
            Report.from_json({"time": when, "step": 1, "metrics": {}})
    assert Report.from_json({"time": 0.0, "step": 1, "metrics": {}}).time == 0.0


@pytest.mark.parametrize("rows", [
    [(-1e308, 1), (1e308, 2)],  # the review's pair (a store written before the bound)
    [(0.0, 0), (5e-324, 2**63 - 1)],  # within the bound: 2**63 steps in no time at all
    [(0.0, 0), (MAX_TIME, 1)],  # one step over eight thousand years
    ['Infinity', 1], [1.0, 'Infinity'], [1.0, 2.0, 'NaN'],  # lines no driver writes: JSON has no such numbers
])
def test_the_views_progress_answers_whatever_reports_the_store_holds(tmp_path, rows):
    """Every duration the view shows is total: no metrics file makes the metrics route answer 500."""
    from fastapi.responses import JSONResponse

    lines = []
    for row in rows:
        if isinstance(row, tuple):
            lines.append(json.dumps({"time": row[0], "step": row[1], "total_steps": 2**63 - 1, "values": {"loss": 1.0}}))
        else:
            lines.append('{"time": %s, "step": %s, "total_steps": 9, "values": {"loss": %s}}' % (row, row, row))
    (tmp_path / store.METRICS).write_text("\n".join(lines) + "\n")
    one_try = view_store.Try(1, store.storage_path(str(tmp_path)), None)
    progress = view._progress(one_try, running=True)
    JSONResponse({"tries": [progress]})  # what the route answers: json.dumps(allow_nan=False) raised ValueError
    assert isinstance(progress["elapsed"], (str, type(None))) and isinstance(progress["eta"], (str, type(None)))


@pytest.mark.parametrize("seconds, text", [(float("inf"), "-"), (float("nan"), "-"), (-5.0, "-"), (1e308, "over 10000h"),
                                           (108.0, "1m48s")])
def test_every_duration_text_is_total(seconds, text):
    assert duration_text(seconds) == text


# -- T4-7: a version's marker is the runner's, never a user's file --------------------------------------
def test_a_checkpoint_file_named_like_the_version_marker_is_refused_and_said(tmp_path):
    sink = VersionSink(tmp_path, keep=5, limits=Limits())
    staging = sink.fresh_staging()
    (staging / "model.pt").write_bytes(b"w")
    (staging / records.VERSION_MARKER).write_text(json.dumps({"seq": 99, "time": 0, "size": 0, "files": []}))
    why = sink.commit(PutVersion(step=1, metrics={}, manifest={"model.pt": 1, records.VERSION_MARKER: 51}),
                      ["model.pt", records.VERSION_MARKER])
    assert "rename that file" in why and records.VERSION_MARKER in why
    assert records.Layout(tmp_path).committed_versions() == []


@pytest.mark.parametrize("rel", [records.VERSION_MARKER + "/weights.pt", "sub/%s/weights.pt" % records.VERSION_MARKER,
                                 ".%s.tmp" % records.VERSION_MARKER, "sub/.%s.tmp/weights.pt" % records.VERSION_MARKER])
def test_the_marker_s_names_are_refused_as_any_folder_or_file_of_a_checkpoint_and_later_versions_commit(tmp_path, rel):
    """Issue 49 (T4-7 again): a *folder* named ``_VERSION.json`` passed the name check, then every
    version failed to commit with ``[Errno 21] Is a directory``; the marker's temporary name too."""
    sink = VersionSink(tmp_path, keep=5, limits=Limits())
    staging = sink.fresh_staging()
    (staging / rel).parent.mkdir(parents=True, exist_ok=True)
    (staging / rel).write_bytes(b"w")
    why = sink.commit(PutVersion(step=1, metrics={}, manifest={rel: 1}), [rel])
    assert why is not None and "rename that file or folder" in why and rel in why
    staging = sink.fresh_staging()
    (staging / "model.pt").write_bytes(b"w")
    assert sink.commit(PutVersion(step=2, metrics={}, manifest={"model.pt": 1}), ["model.pt"]) is None
    assert [v.step for v, _ in records.Layout(tmp_path).committed_versions()] == [2]


# -- T4-10: rank 0 cannot replace the driver's files; one huge line costs nothing ---------------------
def test_files_rank_0_wrote_beside_its_checkpoint_folder_never_replace_the_drivers(tmp_path, caplog):
    staging = tmp_path / "out" / ".incoming"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints" / "model.pt").write_bytes(b"w")
    (staging / store.METRICS).write_text('{"step": 1, "time": 1.0, "values": {"forged": 1}}\n')
    (staging / store.RESULT_FILE).write_bytes(b"forged")
    marker = commit(tmp_path / "out", staging, status="success", complete=True, run_id="r", received=[])
    assert marker.complete and sorted(os.listdir(tmp_path / "out")) == ["_RUN.json", "checkpoints"]
    assert "metrics.jsonl is not kept" in caplog.text
    folder = store.storage_path(str(tmp_path / "try-1"))
    folder.mkdir()
    (tmp_path / "try-1" / store.METRICS).write_text('{"step": 1, "time": 1.0, "values": {"loss": 1}}\n')
    (tmp_path / "out" / store.METRICS).write_text("forged\n")  # even if it were there
    stored = store.store_try(tmp_path / "out", folder, store.TryMarker(status=store.TryStatus.SUCCESS, complete=False))
    assert store.METRICS not in stored.stored_files
    assert store.read_metrics(folder, max_rows=10)[0]["values"] == {"loss": 1}


def test_one_huge_metrics_line_is_skipped_without_being_held(tmp_path):
    row = '{"step": %d, "time": 1.0, "values": {"loss": 1}}\n'
    padded = '{"step": 2, "time": 1.0, "values": {"loss": 1}, "pad": "%s"}\n' % ("x" * (32 << 20))
    (tmp_path / store.METRICS).write_text(row % 1 + padded + row % 3)
    tracemalloc.start()
    try:
        rows = store.read_metrics(store.storage_path(str(tmp_path)), max_rows=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r["step"] for r in rows] == [1, 3]
    assert peak < 4 << 20  # the 32 MiB line was never held


# -- T4-8: the view lists a try's own versions only --------------------------------------------------
def test_the_views_version_listing_follows_no_link(tmp_path):
    mine = tmp_path / "root" / "d" / "r" / "t" / "try-1"
    theirs = tmp_path / "root" / "other" / "r" / "t" / "try-1"
    for folder, seq in ((mine, 1), (theirs, 7)):
        version = records.Layout(folder).version(seq)
        version.mkdir(parents=True)
        (version / "model.pt").write_bytes(b"w")
        (version / records.VERSION_MARKER).write_text(json.dumps(
            records.Version(seq=seq, step=seq, time=0.0, size=1, files=(("model.pt", 1),)).to_json()))
    os.symlink(records.Layout(theirs).version(7), records.Layout(mine).version(2))
    one_try = view_store.Try(1, store.storage_path(str(mine)), None,
                             view_store.LocalFolder(str(tmp_path / "root"), ("d", "r", "t", "try-1")))
    assert [v["seq"] for v in one_try.versions()] == [1]


# -- T4-13: a timeline that cannot be drawn is remembered as such -------------------------------------
def test_a_timeline_that_cannot_be_drawn_answers_and_is_parsed_once(tmp_path, monkeypatch):
    (tmp_path / store.TIMELINE).write_text(json.dumps([{"name": "ALLREDUCE", "ph": "B", "pid": 1, "ts": 1}]))
    one_try = view_store.Try(1, store.storage_path(str(tmp_path)), store.TryMarker(
        status=store.TryStatus.SUCCESS, complete=True, stored_files=(store.TIMELINE,), committed_at=1.0))
    parsed = []

    def crafted(events):
        parsed.append(1)
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(view_store.hvd_timeline, "parse", crafted)
    pictures = view._Pictures()
    assert pictures.get(one_try, "t") is None
    assert pictures.get(one_try, "t") is None
    assert parsed == [1]
