"""A peer without a key cannot hold the handshake open, lock keyed clients out, stall a client, or
flood the log. Findings N1 (the handshake's half), N9 and N10 of issue #21."""

from __future__ import annotations

import logging
import socket
import threading
import time

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import TaskStarted
from tests.security.attacker import SECRET, TASK, hung_up, settle

ATTACKER = "127.0.0.2"  # another source address (all of 127/8 is this machine's)


def test_a_peer_dribbling_its_handshake_is_dropped_at_the_deadline(monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 1.0)
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        sock = socket.create_connection(address, timeout=5)
        sock.recv(wire.NONCE_BYTES)
        began = time.monotonic()
        prefix = bytes([4]) + b"task" + b"n" * wire.NONCE_BYTES + bytes(64)
        dropped = False
        for byte in prefix:  # one byte every 0.3 s: each read of the server's returns well within its limit
            if hung_up(sock, timeout=0.3):
                dropped = True
                break
            try:
                sock.send(bytes([byte]))
            except OSError:
                dropped = True
                break
        held = time.monotonic() - began
        sock.close()
    finally:
        channel.close()
    assert dropped and held < 2.5, "the dribbler held its handshake for %.1f s" % held  # the review: for ever


def test_one_source_without_a_key_cannot_lock_out_keyed_clients():
    events = []
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    idle = [socket.create_connection(address, source_address=(ATTACKER, 0)) for _ in range(64)]  # every pending slot
    try:
        assert sum(hung_up(s, timeout=0.5) for s in idle) == 48  # a quarter of the 64 slots per address
        conn = wire.connect(address, TASK, timeout=3)  # the review: refused for as long as the attacker held on
        conn.send({"t": "hello", "partition": 0, "executor": "e"})
        assert settle(lambda: events == [TaskStarted(0, "e")])
        conn.close()
    finally:
        for sock in idle:
            sock.close()
        channel.close()


def test_connect_gives_up_within_its_timeout_on_a_server_that_answers_byte_by_byte():
    slow = wire.listen("127.0.0.1")

    def dribble() -> None:
        sock, _ = slow.accept()
        for _ in range(wire.NONCE_BYTES):
            try:
                sock.send(b"n")
            except OSError:
                break
            time.sleep(0.25)
        time.sleep(2)
        sock.close()

    threading.Thread(target=dribble, daemon=True).start()
    try:
        began = time.monotonic()
        try:
            wire.connect(slow.getsockname(), TASK, timeout=1)
        except OSError:
            pass
        took = time.monotonic() - began
    finally:
        slow.close()
    assert took < 2, "connect(timeout=1) took %.1f s" % took  # the review: 24.5 s for timeout=2


def test_refused_connections_are_warned_about_at_most_once_an_interval(caplog):
    caplog.set_level(logging.WARNING, logger="airflow_provider_horovod.runner.driver.channel")
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    stranger = wire.Credentials.of(wire.new_secret(), wire.ROLE_TASK)
    try:
        for _ in range(40):
            try:
                wire.connect(address, stranger, timeout=3).close()
            except OSError:
                pass
        assert settle(lambda: channel.rejected == 40)
    finally:
        channel.close()
    refusals = [r for r in caplog.records if "Refused a connection" in r.getMessage()]
    assert len(refusals) == 1  # the review: one record per refusal, 11 740 in 5 s
