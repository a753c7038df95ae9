"""The channel's messages: each survives the wire, and a frame that is not one is a ProtocolError."""

from __future__ import annotations

import json

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner import messages
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.messages import ProtocolError, TransferError, decode
from airflow_provider_horovod.runner.messages import LOG_LINE_CHARS, LOGS_FRAME_BYTES, Logs, Report
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan
from airflow_provider_horovod.runner.rank.reports import Reporter

FACTS = TaskFacts(partition=1, executor="10.0.3.12:48638", address="10.0.3.12", pid=4242, task_dir="/tmp/p1",
                  python="3.11.7", gpus=("0",), service_port=5000, iface="ens5", network="10.0.3.0/24")
FAILURE = Failure(message="Rank 1 failed: ValueError: boom", rank=1, host="hvdhost1", exception="ValueError: boom",
                  traceback="Traceback ...", tail=("epoch 1", "boom"), error_class="PayloadError", time=1.5)

CHANNEL_MESSAGES = [
    messages.Hello(partition=1, executor="10.0.3.12:48638"),
    messages.Facts(FACTS),
    messages.Ready(partition=1),
    messages.Finished(partition=1, tails={"1": ["epoch 1", "boom"]}, failure=FAILURE),
    messages.Finished(partition=0),
    messages.Logs(rank=2, lines=["loss 0.1", ""], callback=True),
    messages.Logs(rank=0, lines=["quiet line"], quiet=True),
    messages.Error(FAILURE),
    messages.Event("orted-launched", partition=1, executor="10.0.3.12:48638"),
    messages.PutArtifacts(),
    messages.FetchResume(partition=1),
    messages.PutVersion(step=7, metrics={"loss": 0.5}, manifest={"model.pt": 1000}),
    messages.Planned(make_plan([FACTS, TaskFacts(partition=0, executor="e0", address="10.0.3.11", pid=1,
                                                 task_dir="/tmp/p0", python="3.11.7")])),
    messages.Start(),
    messages.Stop(),
    messages.Release(),
    messages.Preempting(),
    messages.Report(time=12.5, step=3, total_steps=10, metrics={"loss": 0.5}, rank=0),
]
TRANSFER_MESSAGES = [
    messages.Offer({"root": "/tmp/p0/artifacts", "proof": "/tmp/p0/offer-ab", "token": "0" * 64}),
    messages.Offer(None),
    messages.Mode("stream"),
    messages.FileHeader("checkpoints/model.pt", 1 << 20),
    messages.StreamEnd(3),
    messages.Heartbeat(),
    messages.Received(2),
    messages.Intact(True),
    messages.Receipt(True, files=2),
    messages.Receipt(False, error="rank 0's artifacts are larger than 1 bytes"),
    messages.LaunchOrted(["hvdhost1", "orted", "-mca", "ess", "env"]),
    messages.OrtedStarted(4242),
    messages.OrtedExited(-9),
]


def over_the_wire(frame: dict) -> dict:
    return json.loads(json.dumps(frame))  # what wire.Connection sends is JSON


@pytest.mark.parametrize("msg", CHANNEL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_channel_message_arrives_as_it_was_sent(msg):
    frame = over_the_wire(msg.to_json())
    assert frame["t"] == msg.TYPE
    assert decode(frame) == msg


def test_every_registered_message_type_has_a_round_trip_above():
    assert {type(m) for m in CHANNEL_MESSAGES} == set(messages._BY_TYPE.values())


@pytest.mark.parametrize("msg", TRANSFER_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_transfer_message_arrives_as_it_was_sent(msg):
    assert type(msg).from_json(over_the_wire(msg.to_json())) == msg


def test_a_rank_failure_keeps_every_field_of_its_report():
    frame = over_the_wire(messages.Error(FAILURE).to_json())
    assert frame["exception"] == "ValueError: boom"  # the report's fields sit beside "t", as ranks send them
    assert decode(frame).failure.error_class == "PayloadError"


@pytest.mark.parametrize(("frame", "words"), [
    ({"t": "no-such-message"}, "unknown type 'no-such-message'"),
    ({"partition": 0}, "unknown type None"),
    ({"t": "hello", "executor": "e"}, "hello message without partition"),
    ({"t": "ready"}, "ready message without partition"),
    ({"t": "hello", "partition": "0", "executor": "e"}, "hello message whose partition is str, not int"),
    ({"t": "hello", "partition": True, "executor": "e"}, "hello message whose partition is bool, not int"),
    ({"t": "hello", "partition": 0, "executor": 7}, "hello message whose executor is int, not str"),
    ({"t": "event", "kind": "orted-launched", "partition": "zero"}, "event message whose partition is str"),
    ({"t": "logs", "rank": 0, "lines": "not a list"}, "logs whose lines are not a list"),
    ({"t": "logs", "rank": "0", "lines": []}, "logs message whose rank is str, not int"),
    ({"t": "facts", "facts": {"partition": 0}}, "facts message whose facts are not a task's"),
    ({"t": "facts"}, "facts message whose facts are not a task's"),
    ({"t": "plan", "plan": "[{\"rank\": 0}]"}, "plan message whose plan cannot be read"),
    ({"t": "finished", "partition": 0, "tails": {"0": "not lines"}}, "tails are not lists of lines"),
    ({"t": "finished", "partition": 0, "failure": ["not", "a", "report"]}, "failure is not a report"),
    ({"t": "finished"}, "finished message without partition"),
    ({"t": "logs", "lines": []}, "logs message without rank"),
])
def test_a_malformed_or_unknown_frame_is_a_protocol_error_that_says_what_is_wrong(frame, words):
    with pytest.raises(ProtocolError, match=words.replace("(", r"\(").replace(")", r"\)")):
        decode(frame)


def test_an_exec_request_without_a_list_of_words_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="a request without a list of words"):
        messages.LaunchOrted.from_json({"words": "orted -mca ess env"})


@pytest.mark.parametrize(("frame", "words"), [
    ({"file": "../escape.pt", "size": 1}, "outside the artifact folder"),
    ({"file": 7, "size": 1}, "not plain text"),
    ({"file": "a.pt", "size": True}, "not a byte count"),
    ({"file": "a.pt"}, "not a byte count"),
])
def test_a_stream_file_header_that_breaks_the_rules_is_a_transfer_error(frame, words):
    with pytest.raises(TransferError, match=words):
        messages.FileHeader.from_json(frame)


def test_a_second_message_of_one_type_is_refused_at_import():
    with pytest.raises(TypeError, match="two channel messages of type 'hello'"):
        messages.message("hello")(type("Greeting", (messages.Message,), {}))


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


class _Raw:
    """A frame as a broken rank would send it (ChannelClient sends what ``to_json`` gives)."""

    def __init__(self, frame):
        self.frame = frame

    def to_json(self):
        return self.frame


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
    assert [m.step for m in client.messages] == [99_999]
    reporter.offer(Report.make(1.0, 100_000, None, {}))
    reporter.close()
    assert len(client.messages) == 1  # after the rank's end nothing more travels


def test_the_channel_passes_on_rank_0s_reports_only_and_hangs_up_on_a_malformed_one():
    import queue as queue_

    from airflow_provider_horovod.runner import wire
    from airflow_provider_horovod.runner.client import ChannelClient
    from airflow_provider_horovod.runner.driver.channel import Channel

    secret, got = wire.new_secret(), queue_.Queue()
    channel = Channel(secret, on_report=got.put)
    address = channel.start("127.0.0.1")
    clients = {rank: ChannelClient(address, wire.Credentials.of(secret, wire.rank_role(rank))) for rank in (0, 1)}
    try:
        clients[1].send_now(Report.make(1.0, 5, 10, {"loss": 9.0}))  # rank 1 reports: dropped
        clients[0].send_now(Report.make(2.0, 5, 10, {"loss": 0.5}))
        assert got.get(timeout=10) == Report(time=2.0, step=5, total_steps=10, metrics={"loss": 0.5}, rank=0)
        clients[0].send_now(_Raw({"t": "report", "time": 3.0, "metrics": {"loss": "high"}}))
        clients[0].send_now(Report.make(4.0, 6, 10, {"loss": 0.4}))  # after the hang-up: never arrives
        with pytest.raises(queue_.Empty):
            got.get(timeout=1)
    finally:
        for client in clients.values():
            client.close()
        channel.close()


def test_a_ranks_output_travels_in_frames_the_driver_accepts_however_long_its_lines():
    lines = ["short", "\u00e9\U0001f600" * 40000, "x" * 300000, ""] + ["line %d" % i for i in range(20000)]
    batches = Logs.batches(3, lines, quiet=True)
    assert all(len(json.dumps(b.to_json())) <= LOGS_FRAME_BYTES + 100 for b in batches) and len(batches) >= 3
    assert all(b.rank == 3 and b.quiet and not b.callback for b in batches)
    sent = [line for b in batches for line in b.lines]
    assert max(map(len, sent)) == LOG_LINE_CHARS and "".join(sent) == "".join(lines)
    assert sent[0] == "short" and sent[-1] == "line 19999" and "" in sent
