"""What an attacker on the cluster network does, with plain sockets: no help from the engine."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time

from airflow_provider_horovod.runner import wire

SECRET = wire.new_secret()
TASK = wire.Credentials.of(SECRET, wire.ROLE_TASK)
RANK = wire.Credentials.of(SECRET, wire.rank_role(0))  # rank 0: each rank has a key of its own
EXEC = wire.Credentials.of(SECRET, wire.ROLE_EXEC)


def settle(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def hung_up(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (reading and dropping what it sends)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def raw_hello(address: tuple[str, int], role: str = wire.ROLE_TASK) -> socket.socket:
    """A connection that has said which role it claims, with a proof not made with its key."""
    sock = socket.create_connection(address, timeout=5)
    sock.sendall(bytes([len(role)]) + role.encode() + b"n" * wire.NONCE_BYTES + bytes(wire.KNOCK_PROOF))
    return sock


# Another local user holding handshakes open from several source addresses: ``per_address``
# connections from each, each reopened the moment the server drops it (issue 40's T4-1).
_FLOOD = """
import socket, sys, threading, time
port, per_address, addresses = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def hold(source):
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0)) as sock:
                while sock.recv(4096):
                    pass
        except OSError:
            time.sleep(0.002)
for address in addresses:
    for _ in range(per_address):
        threading.Thread(target=hold, args=(address,), daemon=True).start()
print("flooding", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def flood_as_another_user(port: int, sources: int, per_address: int = 24):
    """While inside, a process of ``nobody`` floods ``port`` from 127.0.0.2 and the next ``sources - 1`` addresses."""
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # one that nobody may run
    addresses = ["127.0.0.%d" % (2 + n) for n in range(sources)]
    proc = subprocess.Popen([python, "-I", "-c", _FLOOD, str(port), str(per_address), *addresses], user=65534,
                            group=65534, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert proc.stdout.readline().strip() == "flooding"
        time.sleep(1.0)  # every connection open, the server's pending room taken
        yield proc
    finally:
        proc.kill()
        proc.wait()


# A man in the middle: a TCP relay in a process of its own that records every byte it forwards, in
# both directions, and may change the frames a client sends (issue 40's T4-9). It knows the wire's
# layout (knock, then ``length || ciphertext || tag`` frames), not its keys.
_RELAY = """
import socket, struct, sys, threading
upstream, record, mode, target = (sys.argv[1], int(sys.argv[2])), sys.argv[3], sys.argv[4], int(sys.argv[5])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
lock = threading.Lock()
def keep(data):
    with lock, open(record, "ab") as out:
        out.write(data)
def exact(sock, n):
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError
        buf += got
    return buf
def frames_of(client):
    first = exact(client, 1)
    yield first + exact(client, first[0] + %(nonce)d + %(proof)d)
    while True:
        header = exact(client, 4)
        yield header + exact(client, struct.unpack("!I", header)[0] + %(tag)d)
def changed(frames):
    held = None
    for i, frame in enumerate(frames):  # 0: the knock, 1: the hello, 2...: messages
        if i != target or mode == "pass":
            yield frame
            if held is not None:
                yield held
                held = None
        elif mode == "tamper":
            yield frame[:-20] + bytes([frame[-20] ^ 1]) + frame[-19:]
        elif mode == "replay":
            yield frame
            yield frame
        elif mode == "reorder":
            held = frame
        elif mode == "truncate":
            size = struct.unpack("!I", frame[:4])[0] // 2
            yield struct.pack("!I", size) + frame[4:4 + size] + frame[-%(tag)d:]
def up(client, server):
    for frame in changed(frames_of(client)):
        keep(frame)
        server.sendall(frame)
def down(server, client):
    while data := server.recv(65536):
        keep(data)
        client.sendall(data)
def pump(how, *socks):
    try:
        how(*socks)
    except OSError:
        pass
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    client, _ = listener.accept()
    server = socket.create_connection(upstream)
    threading.Thread(target=pump, args=(up, client, server), daemon=True).start()
    threading.Thread(target=pump, args=(down, server, client), daemon=True).start()
""" % {"nonce": wire.NONCE_BYTES, "proof": wire.KNOCK_PROOF, "tag": wire.TAG_BYTES}


@contextlib.contextmanager
def relay(upstream: tuple[str, int], record: str, mode: str = "pass", target: int = 2):
    """While inside, a relay process listens on 127.0.0.1 and forwards each connection to ``upstream``,
    appending every byte it forwards to the file ``record``; yields its address. ``mode`` changes
    frame ``target`` of what each client sends (0 is the knock, 1 the hello): ``tamper`` flips one
    bit of it, ``replay`` sends it twice, ``reorder`` sends it after the next one, ``truncate`` cuts
    it to half its length (header rewritten, tag kept); ``pass`` changes nothing."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", _RELAY, upstream[0], str(upstream[1]), record, mode,
                             str(target)], stdout=subprocess.PIPE, text=True)
    try:
        yield ("127.0.0.1", int(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait()
