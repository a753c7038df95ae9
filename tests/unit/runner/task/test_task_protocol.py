"""One barrier task against a real driver channel, the test playing the driver: no Spark, no ranks."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.task import barrier
from airflow_provider_horovod.runner.task.barrier import run_task
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import TaskFinished, TaskStarted
from airflow_provider_horovod.runner.spec import RunSpec
from airflow_provider_horovod.runner.messages import Release


class FakeBarrierContext:
    """What ``run_task`` asks of ``BarrierTaskContext``; Spark's allGather must never be called."""

    def partitionId(self) -> int:  # noqa: N802 - Spark's name
        return 0

    def getTaskInfos(self):  # noqa: N802 - Spark's name
        return [SimpleNamespace(address="127.0.0.1:1")]

    def resources(self) -> dict:
        raise RuntimeError("the resource profile went away")  # anything a task can hit before its ranks start

    def allGather(self, message: str):  # noqa: N802 - Spark's name
        raise AssertionError("the channel path must not use Spark's allGather")

    def barrier(self) -> None:
        raise AssertionError("the channel path must not use Spark's barrier")


def test_a_task_that_fails_before_its_ranks_start_reports_it_and_waits_to_be_released(monkeypatch):
    # A task whose driver hangs up ends its own process; here that process is pytest's.
    monkeypatch.setattr(barrier, "abort_task", lambda task: None)
    secret = wire.new_secret()
    events: queue.Queue = queue.Queue()
    channel = Channel(secret, on_event=events.put)
    address = channel.start("127.0.0.1")
    spec = RunSpec(run_id="abc123", secret=secret, payload=b"unused", launcher="gloo", verbosity="all",
                   channel=address, env={}, driver_python="3.11.0")
    rows: list = []
    task = threading.Thread(target=lambda: rows.extend(run_task(FakeBarrierContext(), spec)), daemon=True)
    task.start()
    try:
        assert isinstance(events.get(timeout=10), TaskStarted)
        finished = events.get(timeout=10)
        assert isinstance(finished, TaskFinished) and finished.partition == 0
        assert finished.failure.message == ("The barrier task of partition 0 (executor 127.0.0.1:1) failed: "
                                            "RuntimeError: the resource profile went away")
        assert "ctx.resources()" in finished.failure.traceback
        assert task.is_alive()  # it waits for the driver's release (other hosts may still need its services)
        channel.send_tasks(Release())
        task.join(10)
        assert not task.is_alive() and rows == []
    finally:
        channel.close()
