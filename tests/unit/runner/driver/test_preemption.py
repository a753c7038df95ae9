"""The preemption notice on the driver side: the restart's bounded wait for rank 0's version (the
task's flag file and the rank's side: ``rank/test_preemption.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from airflow_provider_horovod import HorovodRunner


def _noticed(seconds_ago: float, versions: int):
    """An attempt that got a decommission notice ``seconds_ago``, when the run had ``versions`` versions."""
    return SimpleNamespace(preempted_at=time.monotonic() - seconds_ago, versions_at_notice=versions)


def test_a_restart_after_a_notice_waits_for_rank_0s_version_then_goes_at_once():
    runner = HorovodRunner(2)
    sink = SimpleNamespace(committed=["v1"])
    threading.Timer(0.3, lambda: sink.committed.append("v2")).start()  # the notice's version lands
    began = time.monotonic()
    runner._await_preempted_version(_noticed(0.0, 1), sink)
    assert 0.25 < time.monotonic() - began < 2 and sink.committed == ["v1", "v2"]


def test_the_wait_for_a_version_is_bounded_by_preempt_grace_from_the_notice_and_by_a_cancel():
    runner = HorovodRunner(2)
    grace = runner.deadlines.preempt_grace_s
    began = time.monotonic()
    runner._await_preempted_version(_noticed(grace - 0.3, 1), SimpleNamespace(committed=["v1"]))
    assert 0.2 < time.monotonic() - began < 2  # what was left of the grace, no more
    runner.cancel()
    began = time.monotonic()
    runner._await_preempted_version(_noticed(0.0, 1), SimpleNamespace(committed=["v1"]))
    assert time.monotonic() - began < 0.5
