"""The channel's typed messages: what training code may report, and what the driver refuses."""

from __future__ import annotations

import json

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.reports import Reporter
from airflow_provider_horovod.runner.wire import ProtocolError


def test_a_report_round_trips_as_json_with_numbers_only():
    numpy = pytest.importorskip("numpy")
    report = Report.make(12.5, numpy.int64(3), 10, {"loss": numpy.float32(0.5), "acc": 1})
    again = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report and again.metrics == {"loss": 0.5, "acc": 1.0} and again.step == 3


@pytest.mark.parametrize("kwargs, error", [
    ({"loss": "0.4"}, "runtime.report\\(loss=...\\) takes a number"),
    ({"loss": True}, "takes a number"),
    ({"loss": float("nan")}, "report finite numbers"),
    ({"step": 1.5}, "step=...\\) takes an int >= 0"),
    ({"total_steps": -1}, "total_steps=...\\) takes an int >= 0"),
])
def test_runtime_report_refuses_what_is_not_a_number_with_an_error_that_says_so(kwargs, error):
    with pytest.raises((TypeError, ValueError), match=error):
        runtime.report(**kwargs)


@pytest.mark.parametrize("raw", [
    None, {"t": "report"}, {"t": "report", "time": 1.0, "metrics": []},
    {"t": "report", "time": "now", "metrics": {}}, {"t": "report", "time": 1.0, "metrics": {"loss": "x"}},
    {"t": "report", "time": 1.0, "step": -3, "metrics": {}},
])
def test_a_malformed_report_on_the_channel_is_a_protocol_error(raw):
    with pytest.raises(ProtocolError):
        Report.from_json(raw)


class _Sent:
    def __init__(self):
        self.messages = []

    def send(self, msg):
        self.messages.append(msg)


def test_reports_are_coalesced_to_the_newest_and_the_last_one_is_sent_on_close():
    client = _Sent()
    reporter = Reporter(client, interval=3600.0)  # the thread never sends by itself in this test
    for step in range(100_000):
        reporter.offer(Report.make(float(step), step, 100_000, {"loss": 1.0 / (step + 1)}))
    assert client.messages == []
    reporter.close()
    assert [m["step"] for m in client.messages] == [99_999]
    reporter.offer(Report.make(1.0, 100_000, None, {}))
    reporter.close()
    assert len(client.messages) == 1  # after the rank's end nothing more travels


def test_the_channel_passes_on_rank_0s_reports_only_and_hangs_up_on_a_malformed_one():
    import queue as queue_

    from airflow_provider_horovod.runner import wire
    from airflow_provider_horovod.runner.channel import Channel, ChannelClient

    secret, got = wire.new_secret(), queue_.Queue()
    channel = Channel(secret, on_report=got.put)
    address = channel.start("127.0.0.1")
    clients = {rank: ChannelClient(address, wire.Credentials.of(secret, wire.rank_role(rank))) for rank in (0, 1)}
    try:
        clients[1].send_now(Report.make(1.0, 5, 10, {"loss": 9.0}).to_json())  # rank 1 reports: dropped
        clients[0].send_now(Report.make(2.0, 5, 10, {"loss": 0.5}).to_json())
        assert got.get(timeout=10) == Report(time=2.0, step=5, total_steps=10, metrics={"loss": 0.5})
        clients[0].send_now({"t": "report", "time": 3.0, "metrics": {"loss": "high"}})
        clients[0].send_now(Report.make(4.0, 6, 10, {"loss": 0.4}).to_json())  # after the hang-up: never arrives
        with pytest.raises(queue_.Empty):
            got.get(timeout=1)
    finally:
        for client in clients.values():
            client.close()
        channel.close()
