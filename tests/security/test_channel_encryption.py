"""The channel is encrypted (issue 40, T4-9): a relay between the ranks and the driver sees no
checkpoint byte, metric name or rank output, and a frame it alters, replays, reorders or truncates is
refused, which fails the run cleanly."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from pathlib import Path

import pytest

from airflow_provider_horovod.runner import names, wire
from airflow_provider_horovod.runner.driver.channel import Channel
from tests.security.attacker import SECRET, TASK, relay, settle

PATTERN = b"CKPT-PATTERN-\x13\x37-"  # a checkpoint's bytes, repeated
METRIC = "patient_id_auc"
OUTPUT = "rank-output-that-must-stay-private"


@pytest.fixture
def relayed(tmp_path, monkeypatch):
    """Every connection to the run's channel goes through a relay process recording what it forwards;
    rank 0's artifacts are streamed (as from another host), not copied."""
    record = tmp_path / "relayed.bin"
    mode = {"mode": "pass"}
    stack = contextlib.ExitStack()
    start = Channel.start

    def start_behind_relay(self, host):
        address = start(self, host)
        return stack.enter_context(relay(address, str(record), mode["mode"])) if address else address

    monkeypatch.setattr(Channel, "start", start_behind_relay)
    monkeypatch.setenv(names.ENV_ARTIFACT_TRANSPORT, "stream")
    with stack:
        yield record, mode


def _train():
    from airflow_provider_horovod import runtime

    print(OUTPUT, flush=True)
    runtime.report(step=1, **{METRIC: 0.5})
    (Path(runtime.checkpoint_dir()) / "model.pt").write_bytes(PATTERN * 8192)
    return "trained"


def test_a_relay_sees_no_checkpoint_byte_metric_name_or_rank_output(tmp_path, relayed, caplog, no_leftover_processes):
    from airflow_provider_horovod import HorovodRunner

    record, _mode = relayed
    reports = []
    runner = HorovodRunner(-1, launcher="gloo", artifact_dir=tmp_path / "out", on_report=reports.append)
    with caplog.at_level(logging.INFO):
        assert runner.run(_train) == "trained"
    # all three crossed the relay: the driver has them ...
    assert (tmp_path / "out" / "checkpoints" / "model.pt").read_bytes() == PATTERN * 8192
    assert any(METRIC in r.metrics for r in reports)
    assert OUTPUT in caplog.text
    # ... and the relay saw them only encrypted
    seen = record.read_bytes()
    assert len(seen) > len(PATTERN) * 8192
    for secret in (PATTERN, METRIC.encode(), OUTPUT.encode(), b'"t": "'):
        assert secret not in seen


@pytest.mark.parametrize("change", ["tamper", "replay", "reorder", "truncate"])
def test_a_run_whose_frames_are_changed_on_the_way_fails_cleanly_and_says_so(tmp_path, relayed, change,
                                                                             no_leftover_processes):
    from airflow_provider_horovod import HorovodRunner
    from airflow_provider_horovod.exceptions import HorovodRunError

    _record, mode = relayed
    mode["mode"] = change
    runner = HorovodRunner(-1, launcher="gloo", artifact_dir=tmp_path / "out", start_timeout=20)
    with pytest.raises(HorovodRunError) as raised:
        runner.run(_train)
    assert re.search(r"refused \d+ frame\(s\) from this run's own processes: a frame failed verification", str(raised.value))
    assert not (tmp_path / "out" / "checkpoints" / "model.pt").exists()


@pytest.mark.parametrize("mode", ["tamper", "replay", "reorder", "truncate"])
def test_a_frame_altered_replayed_reordered_or_truncated_is_refused(tmp_path, mode):
    listener = wire.listen("127.0.0.1")
    got, errors = [], []

    def handle(conn: wire.ServerConnection) -> None:
        try:
            while True:
                got.append(conn.recv())
        except ConnectionError as err:
            errors.append(err)

    server = wire.serve(listener, wire.server_keys(SECRET, wire.ROLE_TASK), handle, "test-server")
    try:
        with relay(listener.getsockname(), str(tmp_path / "record"), mode, target=3) as address:
            conn = wire.connect(address, TASK)
            for n in range(4):
                conn.send({"t": "log", "n": n, "pad": "x" * 64})
            assert settle(lambda: errors)
            conn.close()
    finally:
        wire.stop_listening(listener)
        server.thread.join(5)
    # frame 3 is message 1: what came before it is served, nothing after it (a replayed frame: its first copy)
    assert [m["n"] for m in got] == ([0, 1] if mode == "replay" else [0])
    assert isinstance(errors[0], wire.AuthenticationError)
    assert "failed verification" in str(errors[0]) and "replayed, reordered or cut short" in str(errors[0])


def test_a_frame_sent_back_to_its_sender_is_refused():
    # Each direction has a key of its own: a relay reflecting a client's frame back to it gets nowhere.
    ours, theirs = socket.socketpair()
    client = wire.ClientConnection(ours, bytes(32), wire.ROLE_TASK)
    try:
        client.send({"t": "log", "n": 0})
        theirs.sendall(theirs.recv(4096))
        with pytest.raises(wire.AuthenticationError, match="failed verification"):
            client.recv()
    finally:
        client.close()
        theirs.close()
