"""A peer without a key cannot hold the handshake open, lock keyed clients out, stall a client, or
flood the log. Findings N1 (the handshake's half), N9 and N10 of issue #21; T4-1 of issue 40 (several addresses)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.launchers.mpirun import ExecService
from tests.security.attacker import EXEC, SECRET, TASK, flood_as_another_user, hung_up, settle


def test_a_peer_dribbling_its_handshake_is_dropped_at_the_deadline(monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 1.0)
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        sock = socket.create_connection(address, timeout=5)
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


def _keyed_clients_get_in(address: tuple[str, int], credentials: wire.Credentials, tries: int = 14) -> int:
    """How many of ``tries`` keyed clients complete their handshake (each given 2 s), one after another."""
    got_in = 0
    for _ in range(tries):
        try:
            wire.connect(address, credentials, timeout=2).close()
            got_in += 1
        except OSError:
            pass
    return got_in


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user (nobody) needs root")
@pytest.mark.parametrize("sources", [4, 16])
def test_a_local_user_flooding_from_several_addresses_cannot_lock_out_keyed_clients(sources):
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        with flood_as_another_user(address[1], sources):
            assert _keyed_clients_get_in(address, TASK) == 14  # the review, from 4 addresses: 0 of 14
    finally:
        channel.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user (nobody) needs root")
@pytest.mark.parametrize("sources", [4, 16])
def test_an_exec_service_flooded_from_several_addresses_still_admits_mpiruns_agent(sources):
    service = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    try:
        with flood_as_another_user(service.port, sources):
            assert _keyed_clients_get_in(("127.0.0.1", service.port), EXEC) == 14  # the review: 0 of 14
    finally:
        service.close()


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


def test_a_recorded_knock_replayed_gets_no_handshake():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    knock = wire._knock(TASK.key, TASK.role.encode(), b"n" * wire.NONCE_BYTES)  # as a keyed client sent it
    try:
        with socket.create_connection(address, timeout=5) as first, socket.create_connection(address, timeout=5) as again:
            first.sendall(knock)
            assert len(first.recv(wire.NONCE_BYTES)) == wire.NONCE_BYTES  # the server's nonce: go on
            again.sendall(knock)
            assert hung_up(again, timeout=3)
        assert settle(lambda: channel.rejected == 1)
    finally:
        channel.close()
