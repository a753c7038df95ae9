"""What a rank process can cost the driver: its frames are typed and sized before they are parsed
(the length at the header, the type from the frame's first bytes), it records no events and a
task only a bounded number, and it holds at most two connections. Finding T4-4 of issue 40, with a rank's own key, as a hostile training function would have it."""

from __future__ import annotations

import json
import time

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import MAX_EVENTS, Channel
from airflow_provider_horovod.runner.messages import Event, Report
from tests.security.attacker import RANK, SECRET, TASK, hung_up


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
    conn.sock.sendall(wire._HEADER.pack(8 << 20) + bytes(wire.MAC_BYTES))  # 8 MiB announced, no body sent
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
