"""What an attacker on the cluster network does, with plain sockets: no help from the engine."""

from __future__ import annotations

import socket
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
    """A connection that has said which role it claims, and nothing that proves it."""
    sock = socket.create_connection(address, timeout=5)
    sock.recv(wire.NONCE_BYTES)
    sock.sendall(bytes([len(role)]) + role.encode() + b"n" * wire.NONCE_BYTES)
    return sock
