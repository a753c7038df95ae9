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
