"""Authenticated framing for every socket the engine opens.

The server greets each connection with a random nonce. Every frame after that carries
``HMAC-SHA256(secret, nonce || sequence number || body)``, so a frame cannot be forged without the
per-run secret, replayed on another connection, or reordered. A frame that fails to verify closes
the connection before its body is looked at.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME = 64 * 1024 * 1024
_HEADER = struct.Struct("!I")


class AuthenticationError(ConnectionError):
    """A peer sent a frame that was not signed with the run's secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise ConnectionError("connection closed")
        pos += got
    return buf


class FramedConnection:
    """One side of an authenticated connection; ``send``/``recv`` move JSON or raw frames."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes) -> None:
        self.sock = sock
        self._secret = secret
        self._nonce = nonce
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()  # one frame at a time, whichever thread sends

    def _mac(self, direction: bytes, seq: int, body: bytes | bytearray | memoryview) -> bytes:
        mac = hmac.new(self._secret, self._nonce + direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def send_bytes(self, body: bytes | bytearray | memoryview, *, direction: bytes = b"c") -> None:
        with self._send_lock:
            mac = self._mac(direction, self._send_seq, body)
            self._send_seq += 1
            if len(body) < 65536:
                self.sock.sendall(_HEADER.pack(len(body)) + mac + bytes(body))
            else:  # large frames (artifact chunks): no copy of the body
                self.sock.sendall(_HEADER.pack(len(body)) + mac)
                self.sock.sendall(body)

    def recv_bytes(self, *, direction: bytes = b"c") -> bytearray:
        (length,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if length > MAX_FRAME:
            raise AuthenticationError("frame too large")
        mac = _recv_exact(self.sock, MAC_BYTES)
        body = _recv_exact(self.sock, length)
        if not hmac.compare_digest(mac, self._mac(direction, self._recv_seq, body)):
            raise AuthenticationError("frame not signed with this run's secret")
        self._recv_seq += 1
        return body

    def send(self, obj: Any, *, direction: bytes = b"c") -> None:
        self.send_bytes(json.dumps(obj).encode(), direction=direction)

    def recv(self, *, direction: bytes = b"c") -> Any:
        return json.loads(self.recv_bytes(direction=direction))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ClientConnection(FramedConnection):
    """Client side: frames it sends are marked ``c``, frames it receives ``s``."""

    def send_bytes(self, body: bytes, *, direction: bytes = b"c") -> None:
        super().send_bytes(body, direction=b"c")

    def recv_bytes(self, *, direction: bytes = b"s") -> bytes:
        return super().recv_bytes(direction=b"s")


class ServerConnection(FramedConnection):
    """Server side: frames it sends are marked ``s``, frames it receives ``c``."""

    def send_bytes(self, body: bytes, *, direction: bytes = b"s") -> None:
        super().send_bytes(body, direction=b"s")

    def recv_bytes(self, *, direction: bytes = b"c") -> bytes:
        return super().recv_bytes(direction=b"c")


def connect(address: tuple[str, int], secret: bytes, timeout: float = 10.0) -> ClientConnection:
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = _recv_exact(sock, NONCE_BYTES)
    return ClientConnection(sock, secret, nonce)


def accept(listener: socket.socket, secret: bytes) -> ServerConnection:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(nonce)
    return ServerConnection(sock, secret, nonce)


def listen(host: str, backlog: int = 64) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(backlog)
    return sock


def serve(listener: socket.socket, secret: bytes, handle: Callable[[ServerConnection], None], name: str) -> threading.Thread:
    """Accept connections on ``listener`` until it is closed; ``handle`` each in a thread of its own."""

    def loop() -> None:
        while True:
            try:
                conn = accept(listener, secret)
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), name=name, daemon=True).start()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
