"""What a rank process can cost the driver: its frames are typed and sized before they are parsed
(the length at the header, the type from the frame's first bytes), it records no events and a
task only a bounded number, it holds at most two connections, and its reports reach the driver's
recorder at most twice a second however it sends them. Findings T4-3 (the channel's half) and T4-4
of issue 40, with a rank's own key, as a hostile training function would have it."""

from __future__ import annotations

import json
import time

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import MAX_EVENTS, REPORT_INTERVAL_S, Channel
from airflow_provider_horovod.runner.messages import Event, Report
from tests.security.attacker import RANK, SECRET, TASK, hung_up, settle


@pytest.fixture
def channel():
    reports: list[Report] = []
    channel = Channel(SECRET, on_report=reports.append)
    channel.reports = reports
    channel.start("127.0.0.1")
    yield channel
    channel.close()


def test_a_rank_frame_longer_than_a_ranks_budget_is_refused_at_its_header(channel):
    conn = wire.connect(channel.address, RANK)
    conn.sock.sendall(wire._HEADER.pack(8 << 20) + bytes(wire.TAG_BYTES))  # 8 MiB announced, no body sent
    assert hung_up(conn.sock, timeout=3)  # the review: 30 such frames of 8 MiB held +268 MB until the run ended


def test_a_frame_of_a_type_a_rank_may_not_send_is_refused_before_it_is_parsed(channel, monkeypatch):
    parsed = []

    class Spy:  # wire's json, counting what it parses
        dumps = staticmethod(json.dumps)

        @staticmethod
        def loads(body):
            parsed.append(len(body))
            return json.loads(body)

    monkeypatch.setattr(wire, "json", Spy)
    conn = wire.connect(channel.address, RANK)
    conn.send_bytes(b'{"t": "facts", "facts": "' + b"x" * (900 << 10) + b'"}')
    assert hung_up(conn.sock, timeout=3)
    assert parsed == []  # the review: frames up to 64 MiB were parsed before their type was looked at


def test_a_rank_records_no_events_and_the_tasks_record_a_bounded_number(channel):
    rank = wire.connect(channel.address, RANK)
    rank.send(Event("orted-launched", executor="x" * 1000).to_json())
    assert hung_up(rank.sock, timeout=3)
    task = wire.connect(channel.address, TASK)
    for partition in range(MAX_EVENTS + 50):
        task.send(Event("orted-launched", partition=partition, executor="e").to_json())
    task.send(Event("orted-launched", executor="x" * (64 << 10)).to_json())  # past an event's size
    assert hung_up(task.sock, timeout=10)
    recorded = channel.recorded()
    assert len(recorded) == MAX_EVENTS and recorded[-1]["partition"] == MAX_EVENTS - 1


def test_a_rank_holds_at_most_two_connections(channel):
    kept = [wire.connect(channel.address, RANK) for _ in range(2)]
    third = wire.connect(channel.address, RANK)
    assert hung_up(third.sock, timeout=3)
    assert not any(hung_up(conn.sock, timeout=0.2) for conn in kept)


def test_reports_sent_past_the_ranks_own_coalescing_reach_the_driver_at_most_once_an_interval(channel):
    conn = wire.connect(channel.address, RANK)
    began = time.monotonic()
    for step in range(500):  # a rank that writes report frames itself, not through runtime.report
        conn.send(Report(time=float(step), step=step).to_json())
    assert settle(lambda: channel.reports and channel.reports[-1].step == 499)
    took = time.monotonic() - began
    allowed = 1 + int(took / REPORT_INTERVAL_S) + 1
    assert len(channel.reports) <= allowed, "%d reports in %.1f s" % (len(channel.reports), took)  # the review: all


def test_the_newest_report_waiting_its_turn_is_delivered_when_the_channel_closes(channel):
    conn = wire.connect(channel.address, RANK)
    for step in range(6):
        conn.send(Report(time=float(step), step=step).to_json())
    assert settle(lambda: channel.reports)
    time.sleep(0.2)  # the other five are read well within the interval (0.5 s)
    channel.close()
    assert channel.reports[-1].step == 5 and len(channel.reports) <= 2
