"""The preemption notice: the task's flag file, ``runtime.preempting()`` and the callback on the rank side
(the restart's bounded wait for rank 0's version on the driver side: ``driver/test_preemption.py``)."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.rank import preemption
from airflow_provider_horovod.runner.task.termination import announce


def test_outside_a_rank_nothing_is_preempting(monkeypatch):
    monkeypatch.delenv(names.ENV_TASK_DIR, raising=False)
    assert runtime.preempting() is False


def test_a_notice_to_the_task_reaches_every_rank_of_it_and_the_callback_runs_once(monkeypatch, tmp_path):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    calls: list[str] = []
    called = threading.Event()
    runtime.on_preemption(lambda: (calls.append(threading.current_thread().name), called.set()))
    assert runtime.preempting() is False and not called.wait(0.3)
    announce(tmp_path)
    announce(tmp_path)  # a second notice changes nothing
    assert called.wait(5) and runtime.preempting() is True
    assert calls == ["hvdrunner-preemption"]


@pytest.mark.parametrize(("callback", "says"), [
    ("save", "Pass the function itself: runtime.on_preemption(save), not runtime.on_preemption(\"save\")"),
    (None, "needs a function to call with no arguments"),
    (lambda step: None, "the callback is called with no arguments, but missing a required argument: 'step'"),
])
def test_a_callback_that_cannot_be_called_is_refused_at_the_call_not_when_a_notice_comes(callback, says, monkeypatch,
                                                                                       tmp_path):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    before = threading.active_count()
    with pytest.raises(TypeError) as info:
        runtime.on_preemption(callback)
    assert says in str(info.value)
    assert threading.active_count() == before  # no watch was started


def test_a_watch_stopped_before_any_notice_never_calls(monkeypatch, tmp_path):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    stop = threading.Event()
    calls: list[int] = []
    thread = preemption.on_preemption(lambda: calls.append(1), stop)
    stop.set()
    thread.join(5)
    announce(tmp_path)
    assert not thread.is_alive() and calls == []
