"""The exec service and the log channel act only on requests signed with the run's secret."""

from __future__ import annotations

import os
import socket
import time

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.channel import Channel, ChannelClient
from airflow_provider_horovod.runner.mpi import ExecService, orted_argv

SECRET = wire.new_secret()


@pytest.fixture
def service(tmp_path):
    launched = []
    svc = ExecService("127.0.0.1", SECRET, dict(os.environ), os.getpid(), on_launch=launched.append)
    yield svc, launched
    svc.close()


def _hung_up(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _settle(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_exec_service_refuses_a_plain_connection_and_runs_nothing(service):
    svc, launched = service
    with socket.create_connection(("127.0.0.1", svc.port)) as sock:
        sock.recv(wire.NONCE_BYTES)
        sock.sendall(b'{"argv": ["orted"]}\n' * 4)
        assert _hung_up(sock)
    _settle(lambda: svc.refused == 1)
    assert svc.refused == 1 and svc.launches == 0 and launched == []


def test_exec_service_refuses_a_wrongly_signed_request_and_runs_nothing(service):
    svc, launched = service
    conn = wire.connect(("127.0.0.1", svc.port), wire.new_secret())
    conn.send({"argv": ["orted", "--version"]})
    conn.sock.settimeout(5)
    with pytest.raises(ConnectionError):
        conn.recv()
    _settle(lambda: svc.refused == 1)
    assert svc.refused == 1 and svc.launches == 0 and launched == []


def test_exec_service_starts_nothing_but_orted_even_when_signed(service, tmp_path):
    svc, launched = service
    marker = tmp_path / "pwned"
    conn = wire.connect(("127.0.0.1", svc.port), SECRET)
    conn.send({"argv": ["touch", str(marker)]})
    conn.sock.settimeout(5)
    with pytest.raises(ConnectionError):
        conn.recv()
    _settle(lambda: svc.refused == 1)
    assert svc.launches == 0 and not marker.exists()


def test_channel_ignores_frames_not_signed_with_the_secret():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        bad = ChannelClient(address, wire.new_secret())
        bad.send({"t": "logs", "rank": 0, "lines": ["forged"]})
        bad.close()
        good = ChannelClient(address, SECRET)
        good.send({"t": "logs", "rank": 1, "lines": ["genuine"]})
        good.close()
        _settle(lambda: channel.rejected == 1 and list(channel.tails.get(1, [])) == ["genuine"])
        assert channel.rejected == 1
        assert dict(channel.tails) == {1: __import__("collections").deque(["genuine"], maxlen=100)}
    finally:
        channel.close()


def test_a_frame_replayed_on_another_connection_is_refused():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        # Record a genuine frame's bytes, then replay them on a new connection (new nonce).
        conn = wire.connect(address, SECRET)
        body = b'{"t": "logs", "rank": 2, "lines": ["once"]}'
        mac = conn._mac(b"c", 0, body)
        frame = wire._HEADER.pack(len(body)) + mac + body
        conn.sock.sendall(frame)
        conn.close()
        with socket.create_connection(address) as sock:
            sock.recv(wire.NONCE_BYTES)
            sock.sendall(frame)
            assert _hung_up(sock)
        _settle(lambda: channel.rejected == 1)
        assert channel.rejected == 1
        assert list(channel.tails[2]) == ["once"]
    finally:
        channel.close()


def test_orted_command_is_split_without_a_shell():
    words = ["PATH=/usr/bin:$PATH", ";", "export", "PATH", ";", "/usr/bin/orted", "-mca", "orte_hnp_uri",
             '"123.0;tcp://127.0.0.1:5000"', "-mca", "plm", "rsh"]
    assert orted_argv(words) == ["orted", "-mca", "orte_hnp_uri", "123.0;tcp://127.0.0.1:5000", "-mca", "plm", "rsh"]
    with pytest.raises(ValueError, match="other than orted"):
        orted_argv(["rm", "-rf", "/"])
