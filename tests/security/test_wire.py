"""The framing every endpoint shares: who may talk, how much an unauthenticated peer can cost, and
that no connection (or burst of them) takes a service down. Findings 3, 6, 8 and 9 of issue #10."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.client import ChannelClient
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import TaskStarted
from airflow_provider_horovod.runner.messages import Logs
from tests.security.attacker import RANK, SECRET, TASK, hung_up, raw_hello, settle

# A driver's channel in a process of its own, so its memory and file descriptors can be measured
# and limited; it prints its port, then every rank line it receives.
CHANNEL_PROCESS = textwrap.dedent("""
    import resource, sys, time
    from airflow_provider_horovod.runner.driver.channel import Channel
    limit = int(sys.argv[2])
    if limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    channel = Channel(bytes.fromhex(sys.argv[1]), output=lambda rank, lines, callback: print(*lines, flush=True))
    print(channel.start("127.0.0.1")[1], flush=True)
    time.sleep(3600)
""")


@pytest.fixture
def channel_process(request):
    limit = getattr(request, "param", 0)
    proc = subprocess.Popen([sys.executable, "-c", CHANNEL_PROCESS, SECRET.hex(), str(limit)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, ("127.0.0.1", port)
    finally:
        proc.kill()
        proc.wait()


def _say(address, line: str) -> None:
    client = ChannelClient(address, RANK)
    assert client.connected
    client.send(Logs(0, [line]))
    client.close()


def test_an_unauthenticated_peer_cannot_make_the_driver_allocate_a_large_frame(channel_process):
    proc, address = channel_process
    before = psutil.Process(proc.pid).memory_info().rss
    socks = []
    for _ in range(3):  # the review's attack: 3 connections claiming 64 MiB frames grew the driver by ~190 MiB
        sock = raw_hello(address)
        sock.sendall(wire._HEADER.pack(wire.MAX_FRAME))
        socks.append(sock)
    assert all(hung_up(s) for s in socks)  # refused at the header, before any body is read
    grown = psutil.Process(proc.pid).memory_info().rss - before
    assert grown < 16 << 20, "the driver grew by %d MiB" % (grown >> 20)
    _say(address, "still serving")
    assert proc.stdout.readline().strip() == "still serving"


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 0.5)
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        with socket.create_connection(address) as sock:
            began = time.monotonic()
            assert hung_up(sock, timeout=5)
            assert time.monotonic() - began < 3
    finally:
        channel.close()


@pytest.mark.parametrize("channel_process", [48], indirect=True)
def test_a_connection_flood_with_a_low_file_limit_does_not_stop_the_channel(channel_process):
    proc, address = channel_process
    flood = []
    for _ in range(200):  # far more than the process may open: accept() fails with EMFILE meanwhile
        try:
            flood.append(socket.create_connection(address, timeout=2))
        except OSError:
            break
    time.sleep(0.5)
    for sock in flood:
        sock.close()
    assert proc.poll() is None
    _say(address, "after the flood")  # the review: the accept loop had ended, nothing was accepted again
    assert proc.stdout.readline().strip() == "after the flood"


def test_pending_handshakes_are_capped_and_the_rest_turned_away():
    listener = wire.listen("127.0.0.1")
    served = []
    server = wire.serve(listener, wire.server_keys(SECRET, wire.ROLE_TASK), served.append, "test", max_unproven=4)
    idle = [socket.create_connection(listener.getsockname()) for _ in range(10)]
    try:
        assert settle(lambda: server.turned_away == 6)
        assert sum(hung_up(s, timeout=0.5) for s in idle) == 6  # the four newest still wait for their knock
    finally:
        for sock in idle:
            sock.close()
        listener.close()


def test_a_frame_that_is_not_an_object_ends_only_its_own_connection():
    events, errors = [], []
    previous = threading.excepthook
    threading.excepthook = errors.append
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, TASK)
        conn.send_bytes(b"[1, 2, 3]")
        assert hung_up(conn.sock)
        conn = wire.connect(address, TASK)
        conn.send({"t": "hello", "partition": 0, "executor": "e"})
        assert settle(lambda: events == [TaskStarted(0, "e")])
        conn.close()
    finally:
        threading.excepthook = previous
        channel.close()
    assert errors == []


def test_a_rank_may_only_report_output_and_failures():
    events = []
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    try:
        for order in ({"t": "hello", "partition": 0, "executor": "e"}, {"t": "put"}, {"t": "fetch-resume"}):
            conn = wire.connect(address, RANK)
            conn.send(order)
            assert hung_up(conn.sock)
        assert events == []
    finally:
        channel.close()


def test_the_client_refuses_a_server_replaying_an_earlier_connection():
    # Record what a genuine server said on one connection (through a relay), then replay it to a new client.
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    relay = wire.listen("127.0.0.1")
    recorded = bytearray()

    def relay_once() -> None:
        client, _ = relay.accept()
        upstream = socket.create_connection(address)
        threading.Thread(target=lambda: _pump(client, upstream, None), daemon=True).start()
        _pump(upstream, client, recorded)

    threading.Thread(target=relay_once, daemon=True).start()
    try:
        wire.connect(relay.getsockname(), TASK).close()
        assert settle(lambda: len(recorded) >= wire.NONCE_BYTES + 4 + wire.TAG_BYTES)
        replayer = wire.listen("127.0.0.1")

        def replay() -> None:
            sock, _ = replayer.accept()
            sock.sendall(bytes(recorded))
            time.sleep(2)
            sock.close()

        threading.Thread(target=replay, daemon=True).start()
        with pytest.raises(wire.AuthenticationError):
            wire.connect(replayer.getsockname(), TASK, timeout=3)
    finally:
        channel.close()
        relay.close()


def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
    try:
        while data := src.recv(65536):
            if record is not None:
                record += data
            dst.sendall(data)
    except OSError:
        pass
    finally:
        dst.close()


def test_connect_gives_up_on_a_server_that_never_greets():
    mute = wire.listen("127.0.0.1")  # accepts (the kernel does) and never says a word
    try:
        began = time.monotonic()
        with pytest.raises(OSError):
            wire.connect(mute.getsockname(), TASK, timeout=1)
        assert time.monotonic() - began < 3  # the review: still blocked after 5 s with timeout=2
    finally:
        mute.close()


def test_keys_are_per_role_and_a_wrong_key_is_refused():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        with pytest.raises(ConnectionError):  # the exec role does not talk to the channel
            wire.connect(address, wire.Credentials.of(SECRET, wire.ROLE_EXEC), timeout=3)
        with pytest.raises(ConnectionError):  # another run's secret
            wire.connect(address, wire.Credentials.of(wire.new_secret(), wire.ROLE_TASK), timeout=3)
        assert settle(lambda: channel.rejected == 2)
        wire.connect(address, TASK).close()
        assert wire.role_key(SECRET, wire.ROLE_RANK) != wire.role_key(SECRET, wire.ROLE_EXEC)
    finally:
        channel.close()
