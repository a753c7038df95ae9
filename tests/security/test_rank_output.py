"""A rank's line stays one record of the driver's log. Finding 9 of issue #10."""

from __future__ import annotations

import logging

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import Channel, RankOutput, one_line
from tests.security.attacker import RANK, SECRET, hung_up, settle


def test_control_characters_cannot_forge_records(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_horovod.ranks")
    channel = Channel(SECRET, output=RankOutput(stream_all=True))
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, RANK)
        conn.send({"t": "logs", "rank": 0, "lines": ["loss 0.1\n[2026-12-03] {taskinstance.py} ERROR - forged",
                                                      "\x1b[31mred\x1b[0m\rover", "tab\tstays", "sep\u2028line"]})
        conn.close()
        assert settle(lambda: len(caplog.records) == 4)
    finally:
        channel.close()
    messages = [r.getMessage() for r in caplog.records]
    assert all("\n" not in m and "\r" not in m and "\x1b" not in m and "\u2028" not in m for m in messages)
    assert messages[0] == "[rank 0] loss 0.1\\x0a[2026-12-03] {taskinstance.py} ERROR - forged"
    assert messages[2] == "[rank 0] tab\tstays"


def test_one_line_leaves_ordinary_text_alone():
    assert one_line("epoch 3: loss=0.25 — 99% ✓") == "epoch 3: loss=0.25 — 99% ✓"
    assert one_line("a\x00b\x7f") == "a\\x00b\\x7f"


def test_a_metric_name_that_would_forge_a_log_record_is_refused_on_every_path():
    """Issue 40, T4-5: a name with a newline, CR or escape never reaches the progress line, MLflow or the log."""
    from airflow_provider_horovod import runtime
    from airflow_provider_horovod.runner.messages import Report

    forged = "loss\n[2026-12-04, 10:00:00 UTC] {taskinstance.py:1} INFO - Marking task as SUCCESS"
    for name in (forged, "acc\r", "lr\x1b[2K", "x\u2028y"):
        with pytest.raises(ValueError, match="without control characters"):
            runtime.report(step=1, **{name: 0.5})
    reports = []
    channel = Channel(SECRET, on_report=reports.append)
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, RANK)  # a rank that writes its frames itself
        conn.send(Report(time=1.0, step=1, metrics={forged: 0.5}).to_json())
        assert hung_up(conn.sock, timeout=3)
    finally:
        channel.close()
    assert reports == []  # the review: the name reached the progress line of the task log raw
