"""A rank speaks only for itself, and a malformed failure report cannot break the verdict.
Finding N12 of issue #21."""

from __future__ import annotations

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import RankFailed
from airflow_provider_horovod.runner.plan import make_plan
from airflow_provider_horovod.runner.driver.supervisor import Deadlines, Supervisor
from tests.security.attacker import SECRET, hung_up, settle


def rank(n: int) -> wire.Credentials:
    return wire.Credentials.of(SECRET, wire.rank_role(n))


def test_a_rank_cannot_write_logs_or_failures_as_another_rank():
    events, shown = [], []
    channel = Channel(SECRET, on_event=events.append, output=lambda r, lines, callback: shown.append((r, lines)))
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, rank(1))
        conn.send({"t": "logs", "rank": 0, "lines": ["posing as rank 0"]})
        conn.send({"t": "error", "rank": 0, "message": "rank 0 failed", "exception": "ValueError: forged"})
        assert settle(lambda: len(events) == 1 and shown)
        conn.close()
        impostor = wire.Credentials(wire.rank_role(0), wire.role_key(SECRET, wire.rank_role(1)))
        refused_before = channel.rejected
        try:
            wire.connect(address, impostor, timeout=3)
        except ConnectionError:
            pass
        assert settle(lambda: channel.rejected == refused_before + 1)  # rank 1's key does not open rank 0's role
    finally:
        channel.close()
    assert shown == [(1, ["posing as rank 0"])]
    assert [e.failure.rank for e in events] == [1]
    assert channel.tails() == {1: ["posing as rank 0"]}


def test_the_shared_rank_key_of_the_first_round_opens_nothing():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        conn_error = None
        try:
            wire.connect(address, wire.Credentials.of(SECRET, wire.ROLE_RANK), timeout=3)
        except ConnectionError as err:
            conn_error = err
        assert conn_error is not None
    finally:
        channel.close()


def test_a_malformed_failure_report_still_gives_a_verdict():
    events = []
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, rank(0))
        conn.send({"t": "error", "exception": 5, "message": ["not", "text"], "tail": 7, "traceback": {"a": 1},
                   "consequence": "no", "time": "soon", "host": 3})
        assert settle(lambda: len(events) == 1)
        assert not hung_up(conn.sock, timeout=0.3)
        conn.close()
    finally:
        channel.close()
    sup = Supervisor(0, coordinated=False, planner=make_plan, deadlines=Deadlines(), now=0.0)
    sup.handle(events[0], 1.0)
    cause = sup.cause  # the review: AttributeError ('int' object has no attribute 'startswith')
    assert isinstance(events[0], RankFailed)
    assert (cause.rank, cause.exception, cause.message, cause.tail, cause.consequence) == \
        (0, "5", "Rank 0 failed: 5", ("7",), False)  # a rank's message is the driver's words for its exception
