"""The driver's side of rank 0's reports: metrics.jsonl, its commits, the progress line, final values."""

from __future__ import annotations

import json
import logging

from airflow_provider_horovod.metrics import COMMIT_INTERVAL_S, MetricsRecorder, duration_text, progress_line
from airflow_provider_horovod.runner.messages import Report


def test_progress_line_says_step_percent_metrics_speed_and_eta():
    first = Report.make(100.0, 0, 5000, {"loss": 2.3})
    newest = Report.make(100.0 + 1200 / 35.2, 1200, 5000, {"loss": 0.41, "acc": 0.88})
    assert progress_line(first, newest) == \
        "Horovod progress: step 1200/5000 (24%), loss 0.41, acc 0.88, 35.2 steps/s, ETA 1m48s"
    assert progress_line(newest, newest) == "Horovod progress: step 1200/5000 (24%), loss 0.41, acc 0.88"
    assert [duration_text(s) for s in (48, 108, 7380)] == ["48s", "1m48s", "2h03m"]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_recorder_keeps_every_report_logs_at_most_once_per_interval_and_commits_every_few_seconds(tmp_path, caplog):
    clock, commits = _Clock(), []
    sent = []  # each commit sends the rows since the one before: appended, they are the whole file
    recorder = MetricsRecorder(tmp_path / "metrics.jsonl",
                               commit=lambda data, base: (sent.append(data), commits.append(len(b"".join(sent).splitlines()))),
                               log=logging.getLogger("test.metrics"), progress_interval=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.metrics"):
        for step in range(1, 41):  # 40 reports half a second apart: 20 s
            clock.now = step * 0.5
            recorder(Report.make(clock.now, step, 100, {"loss": 1.0 / step}))
        final = recorder.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(1, 41))
    assert lines[-1] == {"schema": 1, "step": 40, "total_steps": 100, "time": 20.0, "values": {"loss": 0.025}}
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Horovod progress:")]
    assert [p.split(",")[0] for p in progress] == ["Horovod progress: step 1/100 (1%)", "Horovod progress: step 21/100 (21%)",
                                                   "Horovod progress: step 40/100 (40%)"]  # at 0.5 s, 10.5 s, the end
    assert commits[0] == 1 and commits[-1] == 40 and len(commits) == int(20 / COMMIT_INTERVAL_S) + 1
    assert b"".join(sent) == (tmp_path / "metrics.jsonl").read_bytes()  # never a row twice, none left out
    assert final == {"loss": 0.025, "step": 40, "total_steps": 100}


def test_recorder_without_reports_has_no_metrics_and_commits_nothing(tmp_path):
    commits = []
    recorder = MetricsRecorder(tmp_path / "metrics.jsonl", commit=lambda data, base: commits.append(data),
                               log=logging.getLogger("t"))
    assert recorder.close() == {} and commits == []


def test_a_history_thinned_at_max_bytes_is_committed_as_one_base_and_the_store_stays_bounded(tmp_path, monkeypatch):
    from airflow_provider_horovod import metrics, store

    monkeypatch.setattr(metrics, "MAX_BYTES", 2000)  # ~25 rows
    monkeypatch.setattr(metrics, "COMMIT_INTERVAL_S", 0.0)  # a commit after every report
    folder = store.storage_path(tmp_path / "try-1")
    recorder = MetricsRecorder(tmp_path / "metrics.jsonl", commit=store.MetricsLog(folder).append,
                               log=logging.getLogger("t"))
    for step in range(200):
        recorder(Report.make(float(step), step, 200, {"loss": 1.0}))
    recorder.close()
    steps = [r["step"] for r in store.read_metrics(folder, max_rows=1000)]
    assert steps[0] == 0 and steps[-1] == 199 and steps == sorted(steps)
    assert steps == [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    names = sorted(p.name for p in (tmp_path / "try-1" / "metrics").iterdir())
    assert sum(n.endswith(".base.jsonl") for n in names) == 1  # the objects before the newest base are gone
    assert sum(p.stat().st_size for p in (tmp_path / "try-1" / "metrics").iterdir()) <= 2 * 2000
