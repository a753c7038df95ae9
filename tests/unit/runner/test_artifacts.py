from __future__ import annotations

import json

from airflow_provider_horovod.runner.artifacts import commit, in_progress, load_timeline, read_marker, summarize

HOROVOD_STYLE = (
    '[\n{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad.0"}},\n'
    '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 100, "pid": 1},\n'
    '{"ph": "E", "ts": 150, "pid": 1},\n'
    '{"ph": "B", "name": "ALLREDUCE", "ts": 150, "pid": 1},\n'
    '{"ph": "E", "ts": 350, "pid": 1},\n'
)


def test_unterminated_timeline_is_closed(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(HOROVOD_STYLE)  # what Horovod leaves when the process dies
    assert len(load_timeline(path)) == 5


def test_timeline_cut_mid_event_keeps_every_whole_event(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(HOROVOD_STYLE + '{"ph": "B", "name": "ALLRED')
    events = load_timeline(path)
    assert len(events) == 5 and events[-1] == {"ph": "E", "ts": 350, "pid": 1}


def test_summary_counts_time_per_operation_and_share_of_wall():
    summary = summarize(json.loads(HOROVOD_STYLE.rstrip().rstrip(",") + "]"))
    assert summary["wall_ms"] == 0.25
    assert summary["operations"]["ALLREDUCE"] == {"count": 1, "total_ms": 0.2, "share_of_wall": 0.8}
    assert summary["operations"]["NEGOTIATE_ALLREDUCE"]["count"] == 1


def test_commit_repairs_the_timeline_and_writes_the_marker_last(tmp_path):
    staging = tmp_path / "out" / ".incoming-x"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints" / "epoch-0.pt").write_bytes(b"w")
    (staging / "timeline.json").write_text(HOROVOD_STYLE)
    info = commit(tmp_path / "out", staging, status="failed", complete=True, run_id="x", received=[])
    assert info["checkpoint"] == "checkpoints" and info["timeline"] == "timeline.json"
    assert len(json.loads((tmp_path / "out" / "timeline.json").read_text())) == 5
    assert (tmp_path / "out" / "timeline.svg").read_text().startswith("<svg")
    assert not staging.exists()
    assert read_marker(tmp_path / "out")["status"] == "failed"


def test_incomplete_transfer_stays_in_staging(tmp_path):
    staging = tmp_path / "out" / ".incoming-y"
    (staging / "checkpoints").mkdir(parents=True)
    commit(tmp_path / "out", staging, status="cancelled", complete=False, run_id="y", received=[])
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert read_marker(tmp_path / "out")["complete"] is False


def test_files_being_written_are_recognised():
    assert in_progress("epoch-3.pt.tmp") and in_progress(".epoch-3.pt") and not in_progress("epoch-3.pt")
