"""Authenticated framing for every socket the engine opens.

A connection starts with a mutual handshake. The server sends a random nonce; the client answers
with its role and a nonce of its own, then a ``hello`` frame. Both sides derive the connection's
key from the role's key and both nonces, so a frame recorded on one connection means nothing on
another, in either direction. The server reads at most a small hello before it knows the client
holds the role's key, and the client reads the server's ``welcome`` before it trusts anything.

Every frame after that carries ``HMAC-SHA256(connection key, direction || sequence number || body)``;
a frame that fails to verify closes the connection before its body is looked at.

Keys are per role, derived from the run's secret: barrier tasks (``task``), rank processes
(``rank``: logs and failure reports only) and mpirun's rsh agent (``exec``: the exec services
only). A process gets the key of its own role and nothing more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME = 64 * 1024 * 1024
HELLO_MAX = 4096  # the most a server reads from a peer it has not authenticated yet
HANDSHAKE_TIMEOUT = 10.0
MAX_ROLE = 16
_HEADER = struct.Struct("!I")
_HELLO = b"hvdrunner-hello"
_WELCOME = b"hvdrunner-welcome"

ROLE_TASK = "task"  # a barrier task: the launch protocol and the artifact transfers
ROLE_RANK = "rank"  # a rank process: its output and its failure report
ROLE_EXEC = "exec"  # mpirun's rsh agent: asks an exec service to start orted


class AuthenticationError(ConnectionError):
    """A peer that does not hold the key of the role it claims, or a frame not signed with it."""


class ProtocolError(ConnectionError):
    """An authenticated peer sent something that is not a message of the protocol."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One role's key: what a client proves it holds."""

    role: str
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def of(cls, secret: bytes, role: str) -> Credentials:
        return cls(role, role_key(secret, role))


def role_key(secret: bytes, role: str) -> bytes:
    return hmac.new(secret, b"hvdrunner role:" + role.encode(), hashlib.sha256).digest()


def server_keys(secret: bytes, *roles: str) -> dict[str, bytes]:
    """What a server accepts: the key of each of ``roles``."""
    return {role: role_key(secret, role) for role in roles}


def _session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


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
    """One side of an authenticated connection; ``send``/``recv`` move JSON objects or raw frames."""

    _SEND = b"c"
    _RECV = b"s"

    def __init__(self, sock: socket.socket, key: bytes, role: str) -> None:
        self.sock = sock
        self.role = role
        self._key = key
        self._send_seq = 0
        self._recv_seq = 0
        self._max_frame = MAX_FRAME
        self._send_lock = threading.Lock()  # one frame at a time, whichever thread sends

    def _mac(self, direction: bytes, seq: int, body: bytes | bytearray | memoryview) -> bytes:
        mac = hmac.new(self._key, direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def send_bytes(self, body: bytes | bytearray | memoryview) -> None:
        with self._send_lock:
            mac = self._mac(self._SEND, self._send_seq, body)
            self._send_seq += 1
            if len(body) < 65536:
                self.sock.sendall(_HEADER.pack(len(body)) + mac + bytes(body))
            else:  # large frames (artifact chunks): no copy of the body
                self.sock.sendall(_HEADER.pack(len(body)) + mac)
                self.sock.sendall(body)

    def recv_bytes(self) -> bytearray:
        (length,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if length > self._max_frame:
            raise AuthenticationError("frame of %d bytes is larger than allowed here (%d)" % (length, self._max_frame))
        mac = _recv_exact(self.sock, MAC_BYTES)
        body = _recv_exact(self.sock, length)
        if not hmac.compare_digest(mac, self._mac(self._RECV, self._recv_seq, body)):
            raise AuthenticationError("frame not signed with this run's key")
        self._recv_seq += 1
        return body

    def send(self, obj: dict[str, Any]) -> None:
        self.send_bytes(json.dumps(obj).encode())

    def recv(self) -> dict[str, Any]:
        """The next message: always a JSON object (anything else is a ``ProtocolError``)."""
        body = self.recv_bytes()
        try:
            msg = json.loads(body)
        except ValueError as err:
            raise ProtocolError("a frame that is not JSON") from err
        if not isinstance(msg, dict):
            raise ProtocolError("a frame that is not a JSON object")
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ClientConnection(FramedConnection):
    """Client side: frames it sends are marked ``c``, frames it receives ``s``."""


class ServerConnection(FramedConnection):
    """Server side: frames it sends are marked ``s``, frames it receives ``c``."""

    _SEND = b"s"
    _RECV = b"c"


def _keepalive(sock: socket.socket) -> None:
    """A peer whose host vanished is noticed within about a minute, even on an idle connection."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def connect(address: tuple[str, int], credentials: Credentials, timeout: float = 10.0) -> ClientConnection:
    """Connect and complete the handshake within ``timeout``; the server must prove it holds the key too."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock)
        server_nonce = bytes(_recv_exact(sock, NONCE_BYTES))
        client_nonce = os.urandom(NONCE_BYTES)
        role = credentials.role.encode()
        sock.sendall(bytes([len(role)]) + role + client_nonce)
        conn = ClientConnection(sock, _session_key(credentials.key, server_nonce, client_nonce), credentials.role)
        conn.send_bytes(_HELLO)
        conn._max_frame = HELLO_MAX
        if conn.recv_bytes() != _WELCOME:
            raise AuthenticationError("the server did not welcome us")
        conn._max_frame = MAX_FRAME
        sock.settimeout(None)
        return conn
    except BaseException:
        sock.close()
        raise


def handshake(sock: socket.socket, keys: Mapping[str, bytes], timeout: float | None = None) -> ServerConnection:
    """The server's half: nothing the peer sends is acted on (or read past a small hello) before it
    proves it holds the key of a role this server accepts, within ``HANDSHAKE_TIMEOUT``."""
    sock.settimeout(timeout or HANDSHAKE_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _keepalive(sock)
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(server_nonce)
    size = _recv_exact(sock, 1)[0]
    if not 0 < size <= MAX_ROLE:
        raise AuthenticationError("a malformed handshake")
    role = bytes(_recv_exact(sock, size)).decode("ascii", "replace")
    client_nonce = bytes(_recv_exact(sock, NONCE_BYTES))
    key = keys.get(role)
    if key is None:
        raise AuthenticationError("a peer claiming a role this service does not serve (%r)" % role[:MAX_ROLE])
    conn = ServerConnection(sock, _session_key(key, server_nonce, client_nonce), role)
    conn._max_frame = HELLO_MAX
    if conn.recv_bytes() != _HELLO:
        raise AuthenticationError("a malformed hello")
    conn._max_frame = MAX_FRAME
    conn.send_bytes(_WELCOME)
    sock.settimeout(None)
    return conn


def listen(host: str, backlog: int = 128) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(backlog)
    return sock


def stop_listening(listener: socket.socket) -> None:
    """Stop accepting now: ``shutdown`` wakes a thread blocked in ``accept`` (a bare ``close``
    leaves the kernel listening until that call returns), then close."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        listener.close()


# accept() errors that say "not now" (no descriptors, no buffers, a peer that gave up): the loop waits and goes on
_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EPERM,
              errno.EINTR, errno.EAGAIN)


class Server:
    """Accepts connections on ``listener`` until it is closed; each in a thread of its own.

    Bounded: at most ``max_pending`` connections in their handshake (each for at most
    ``HANDSHAKE_TIMEOUT``) and ``max_connections`` in all; more are closed at once. The loop
    survives running out of file descriptors and any error of a single connection.
    """

    def __init__(self, listener: socket.socket, keys: Mapping[str, bytes], handle: Callable[[ServerConnection], None],
                 name: str, *, max_connections: int = 1024, max_pending: int = 64,
                 on_reject: Callable[[BaseException], None] | None = None) -> None:
        self._listener = listener
        self._keys = dict(keys)
        self._handle = handle
        self._name = name
        self._all = threading.BoundedSemaphore(max_connections)
        self._pending = threading.BoundedSemaphore(max_pending)
        self._on_reject = on_reject or (lambda err: None)
        self.turned_away = 0
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as err:
                if self._listener.fileno() < 0 or err.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    return  # closed
                if err.errno in _TRANSIENT or isinstance(err, socket.timeout):
                    time.sleep(0.05)
                    continue
                log.warning("%s: accept failed (%s); still listening", self._name, err)
                time.sleep(0.05)
                continue
            if not self._all.acquire(blocking=False):
                self._turn_away(sock)
                continue
            if not self._pending.acquire(blocking=False):
                self._all.release()
                self._turn_away(sock)
                continue
            try:
                threading.Thread(target=self._one, args=(sock,), name=self._name, daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._pending.release()
                self._all.release()
                self._turn_away(sock)

    def _turn_away(self, sock: socket.socket) -> None:
        self.turned_away += 1
        with contextlib.suppress(OSError):
            sock.close()

    def _one(self, sock: socket.socket) -> None:
        pending = True
        try:
            try:
                conn = handshake(sock, self._keys)
            except AuthenticationError as err:
                self._on_reject(err)
                return
            except (OSError, ValueError):
                return  # a peer that went away or never finished its hello
            self._pending.release()
            pending = False
            try:
                self._handle(conn)
            except Exception as err:  # noqa: BLE001 - one connection's bug must not end the service
                log.warning("%s: a connection ended with %s: %s", self._name, type(err).__name__, err)
            finally:
                conn.close()
        finally:
            if pending:
                self._pending.release()
            self._all.release()
            with contextlib.suppress(OSError):
                sock.close()


def serve(listener: socket.socket, keys: Mapping[str, bytes], handle: Callable[[ServerConnection], None], name: str,
          **limits: Any) -> Server:
    """Serve authenticated connections on ``listener`` (see ``Server``)."""
    return Server(listener, keys, handle, name, **limits)
