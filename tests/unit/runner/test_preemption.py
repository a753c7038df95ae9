"""The preemption notice on the rank side: the task's flag file, ``runtime.preempting()`` and the callback."""

from __future__ import annotations

import threading

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.rank import preemption


def test_outside_a_rank_nothing_is_preempting(monkeypatch):
    monkeypatch.delenv(names.ENV_TASK_DIR, raising=False)
    assert runtime.preempting() is False


def test_a_notice_to_the_task_reaches_every_rank_of_it_and_the_callback_runs_once(monkeypatch, tmp_path):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    calls: list[str] = []
    called = threading.Event()
    runtime.on_preemption(lambda: (calls.append(threading.current_thread().name), called.set()))
    assert runtime.preempting() is False and not called.wait(0.3)
    preemption.announce(tmp_path)
    preemption.announce(tmp_path)  # a second notice changes nothing
    assert called.wait(5) and runtime.preempting() is True
    assert calls == ["hvdrunner-preemption"]


def test_a_watch_stopped_before_any_notice_never_calls(monkeypatch, tmp_path):
    monkeypatch.setenv(names.ENV_TASK_DIR, str(tmp_path))
    stop = threading.Event()
    calls: list[int] = []
    thread = preemption.on_preemption(lambda: calls.append(1), stop)
    stop.set()
    thread.join(5)
    preemption.announce(tmp_path)
    assert not thread.is_alive() and calls == []
