"""Authenticated, encrypted framing for every socket the engine opens.

A connection starts with a mutual handshake. The client knocks first: its role, a nonce of its
own and a proof made with the role's key over both (``_knock``), so the server tells a keyed client
from a stranger by its first packet, before it gives the connection a thread (``Server``). The
server answers with a random nonce; the client sends a ``hello`` frame. Both sides derive the
connection's key from the role's key and both nonces, so a frame recorded on one connection means
nothing on another, in either direction. The server reads at most a small hello before it knows
the client holds the role's key, and the client reads the server's ``welcome`` before it trusts
anything.

Every frame after that is encrypted and authenticated: AES-256-GCM (NIST SP 800-38D) under a key
of its direction (derived from the connection's key), the frame's 4-byte length as associated data
and the frame's sequence number in its direction as the nonce, so no (key, nonce) pair seals two
frames, and a frame altered, replayed, reordered, dropped or cut short fails its tag, which closes
the connection. On the wire a frame is ``length || ciphertext || tag``: only lengths and timing
cross in clear. With the CPU's AES and carry-less multiply instructions AES-GCM runs at ~9 GB/s a
core here, 2.6x ChaCha20-Poly1305 (see docs/benchmarks.md).

Large frames (artifact chunks) never sit whole in memory: ``send_file`` reads a region of a file
a 256 KiB piece at a time into one buffer, encrypts it there in place and sends it;
``recv_frame_to`` decrypts each piece in place as it arrives, hands it on, and checks the tag at
the frame's end. Its caller must discard what it was handed when that check fails
(``transfer.receive_tree`` removes the partial file).

Keys are per role, derived from the run's secret: barrier tasks (``task``), rank processes
(``rank.<n>``, one key per rank: its own logs and failure report only) and mpirun's rsh agent
(``exec``: the exec services only). A process gets the key of its own role and nothing more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger(__name__)

NONCE_BYTES = 16
TAG_BYTES = 16  # a GCM tag, after each frame's ciphertext
_SLACK = 16  # the cipher's update_into wants its output buffer a block longer than its input
MAX_FRAME = 64 * 1024 * 1024
PIECE = 256 * 1024  # how much of a large frame is in user space at once: encrypted while it is in the CPU's cache
HELLO_MAX = 4096  # the most a server reads from a peer it has not authenticated yet
HANDSHAKE_TIMEOUT = 10.0
MAX_ROLE = 16
KNOCK_PROOF = 16  # bytes of the knock's proof (a truncated HMAC-SHA256 under the role's key)
_HEADER = struct.Struct("!I")
_HELLO = b"hvdrunner-hello"
_WELCOME = b"hvdrunner-welcome"

ROLE_TASK = "task"  # a barrier task: the launch protocol and the artifact transfers
ROLE_RANK = "rank"  # a rank process: its output and its failure report; each rank has a key of its own
ROLE_EXEC = "exec"  # mpirun's rsh agent: asks an exec service to start orted
_RANK_ROLE = re.compile(r"rank\.(\d{1,9})")  # what rank n says on the wire: "rank.<n>", with rank n's key


class AuthenticationError(ConnectionError):
    """A peer that does not hold the key of the role it claims, or a frame not signed with it."""


class ProtocolError(ConnectionError):
    """An authenticated peer sent something that is not a message of the protocol."""


class FrameTooLarge(ProtocolError):
    """An authenticated peer's frame is longer than the reader expects at this point (``length``)."""

    def __init__(self, length: int, most: int) -> None:
        super().__init__("a frame of %d bytes where at most %d were expected" % (length, most))
        self.length = length


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


def rendezvous_token(secret: bytes) -> str:
    """What a Gloo rank's requests to Horovod's rendezvous carry in their path (``gloo.py``)."""
    return hmac.new(secret, b"hvdrunner gloo rendezvous", hashlib.sha256).hexdigest()[:32]


def rank_role(rank: int) -> str:
    """The role rank ``rank`` connects as: its key proves which rank it is, so a rank speaks only for itself."""
    return "%s.%d" % (ROLE_RANK, rank)


def rank_of(role: str) -> int | None:
    """The rank a ``rank.<n>`` role stands for; None for every other role."""
    found = _RANK_ROLE.fullmatch(role)
    return int(found.group(1)) if found else None


def role_family(role: str) -> str:
    """What a role may do: every rank's role is ``rank``."""
    return ROLE_RANK if rank_of(role) is not None else role


class RoleKeys(Mapping):
    """What a server accepts: the key of each of its roles; with ``ranks``, each rank's own key,
    derived when that rank connects."""

    def __init__(self, secret: bytes, roles: tuple[str, ...], *, ranks: bool = False) -> None:
        self._secret = secret
        self._keys = {role: role_key(secret, role) for role in roles}
        self._ranks = ranks

    def __getitem__(self, role: str) -> bytes:
        if role in self._keys:
            return self._keys[role]
        if self._ranks and rank_of(role) is not None:
            return role_key(self._secret, role)
        raise KeyError(role)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return "RoleKeys(%s%s)" % (", ".join(self._keys), ", ranks" if self._ranks else "")


def server_keys(secret: bytes, *roles: str, ranks: bool = False) -> RoleKeys:
    """What a server accepts: the key of each of ``roles`` (and, with ``ranks``, of each rank)."""
    return RoleKeys(secret, roles, ranks=ranks)


def _session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def _time_left(sock: socket.socket, deadline: float | None) -> None:
    """Give the next socket operation only what is left until ``deadline`` (none: as it is)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake took longer than allowed")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf), deadline)
    return buf


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    pos = 0
    while pos < len(view):
        _time_left(sock, deadline)
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError("connection closed")
        pos += got


def _direction_key(session_key: bytes, direction: bytes) -> bytes:
    """The key of one direction of a connection (``c``: client to server, ``s``: server to client)."""
    return hmac.new(session_key, b"hvdrunner direction " + direction, hashlib.sha256).digest()


def scratch() -> memoryview:
    """A buffer for ``send_file`` and ``recv_frame_to``: one piece of a large frame, plus the room the
    cipher asks for to work in place."""
    return memoryview(bytearray(PIECE + _SLACK))


_TYPE_PREFIX = re.compile(rb'\{"t": "([a-z-]{1,32})"')  # how json.dumps starts a message (``t`` first)


def frame_type(body: bytes | bytearray) -> str | None:
    """The type of the message in ``body`` (its ``t``) read from its first bytes, without parsing the rest."""
    found = _TYPE_PREFIX.match(body)
    return found.group(1).decode() if found else None


class FramedConnection:
    """One side of an authenticated, encrypted connection; ``send``/``recv`` move JSON objects or raw frames.

    A frame on the wire is ``length || ciphertext || tag``: the body encrypted with AES-256-GCM under
    this direction's key (``_direction_key``), the 4-byte length as associated data, the frame's
    sequence number in this direction as the nonce. Nothing of the body crosses in clear, and a frame
    that was altered, replayed, reordered, dropped or cut short fails its tag."""

    _SEND = b"c"
    _RECV = b"s"

    def __init__(self, sock: socket.socket, key: bytes, role: str) -> None:
        self.sock = sock
        self.role = role
        self._send_key = _direction_key(key, self._SEND)
        self._recv_key = _direction_key(key, self._RECV)
        self._send_aead = AESGCM(self._send_key)
        self._send_seq = 0
        self._recv_seq = 0
        self._max_frame = MAX_FRAME
        self._deadline: float | None = None  # during the handshake: when it must be over
        self._send_lock = threading.Lock()  # one frame at a time, whichever thread sends

    @staticmethod
    def _nonce(seq: int) -> bytes:
        if seq >= 1 << 64:
            raise ProtocolError("this connection has sent 2**64 frames; open a new one")
        return bytes(4) + seq.to_bytes(8, "big")

    def _next_send_nonce(self) -> bytes:
        nonce = self._nonce(self._send_seq)
        self._send_seq += 1  # a nonce is used once, even by a send that fails half-way
        return nonce

    def send_bytes(self, body: bytes | bytearray | memoryview) -> None:
        with self._send_lock:
            _time_left(self.sock, self._deadline)
            header = _HEADER.pack(len(body))
            sealed = self._send_aead.encrypt(self._next_send_nonce(), body, header)
            if len(body) < 65536:
                self.sock.sendall(header + sealed)
            else:  # large frames: no further copy of the body
                self.sock.sendall(header)
                self.sock.sendall(sealed)

    def send_file(self, file: BinaryIO, offset: int, size: int, scratch: memoryview) -> None:
        """One frame whose body is ``size`` bytes of the open ``file`` from ``offset``, read into
        ``scratch`` (``scratch()``) a piece at a time, encrypted there in place and sent: one piece
        in user space at once. A file that shrank while it was sent is an ``OSError``."""
        piece_size = len(scratch) - _SLACK
        with self._send_lock:
            header = _HEADER.pack(size)
            seal = Cipher(algorithms.AES(self._send_key), modes.GCM(self._next_send_nonce())).encryptor()
            seal.authenticate_additional_data(header)
            self.sock.sendall(header)
            done = 0
            while done < size:
                got = os.preadv(file.fileno(), [scratch[: min(piece_size, size - done)]], offset + done)
                if not got:
                    raise OSError("%s shrank while it was sent" % getattr(file, "name", "a file"))
                seal.update_into(scratch[:got], scratch)  # in place
                self.sock.sendall(scratch[:got])
                done += got
            seal.finalize()
            self.sock.sendall(seal.tag)

    def limit_frames(self, most: int) -> None:
        """From now on a frame longer than ``most`` is a ``FrameTooLarge`` at its header, before its body is read."""
        self._max_frame = min(most, MAX_FRAME)

    def _recv_header(self) -> tuple[int, bytes]:
        header = bytes(_recv_exact(self.sock, _HEADER.size, self._deadline))
        (length,) = _HEADER.unpack(header)
        if length > self._max_frame:
            if self._deadline is None and self._max_frame < MAX_FRAME:  # an authenticated peer past its role's limit
                raise FrameTooLarge(length, self._max_frame)
            raise AuthenticationError("frame of %d bytes is larger than allowed here (%d)" % (length, self._max_frame))
        return length, header

    def _opener(self, header: bytes):
        """A decryptor for the next frame received (its nonce: the next sequence number in this direction)."""
        opener = Cipher(algorithms.AES(self._recv_key), modes.GCM(self._nonce(self._recv_seq))).decryptor()
        opener.authenticate_additional_data(header)
        return opener

    def _verify(self, opener, what: str) -> None:
        tag = bytes(_recv_exact(self.sock, TAG_BYTES, self._deadline))
        try:
            opener.finalize_with_tag(tag)
        except InvalidTag:
            raise AuthenticationError("%s failed verification: not sealed with this connection's key, or altered, "
                                      "replayed, reordered or cut short on the way" % what) from None
        self._recv_seq += 1

    def recv_bytes(self) -> bytearray:
        length, header = self._recv_header()
        body = bytearray(length + _SLACK)
        view = memoryview(body)
        _recv_exact_into(self.sock, view[:length], self._deadline)
        opener = self._opener(header)
        opener.update_into(view[:length], view)  # in place
        view.release()
        self._verify(opener, "a frame")
        del body[length:]
        return body

    def recv_frame_to(self, write: Callable[[memoryview], object], most: int, scratch: memoryview) -> int:
        """The next frame's body, at most ``most`` bytes (else ``FrameTooLarge`` before any is read),
        decrypted a piece at a time in ``scratch`` (``scratch()``) as it arrives and handed to ``write``;
        returns its length. The tag is checked at the frame's end: on ``AuthenticationError`` the
        caller discards what ``write`` was given."""
        length, header = self._recv_header()
        if length > most:
            raise FrameTooLarge(length, most)
        opener = self._opener(header)
        piece_size = len(scratch) - _SLACK
        done = 0
        while done < length:
            piece = scratch[: min(piece_size, length - done)]
            _recv_exact_into(self.sock, piece, self._deadline)
            opener.update_into(piece, scratch)  # in place
            write(piece)
            done += len(piece)
        self._verify(opener, "a frame")
        return length

    def send(self, obj: dict[str, Any]) -> None:
        self.send_bytes(json.dumps(obj).encode())

    def recv(self, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The next message: always a JSON object (anything else is a ``ProtocolError``). With
        ``sizes`` (the most bytes of each message type this peer may send), a frame whose type, read
        from its first bytes (``frame_type``), is not in ``sizes`` or that is longer than its type's
        limit is a ``ProtocolError`` before it is parsed."""
        body = self.recv_bytes()
        if sizes is not None:
            kind = frame_type(body)
            if kind not in sizes:
                raise ProtocolError("a frame of type %r, which this peer may not send" % (kind,))
            if len(body) > sizes[kind]:
                raise FrameTooLarge(len(body), sizes[kind])
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


def _knock(key: bytes, role: bytes, client_nonce: bytes) -> bytes:
    """What a client sends first: its role, its nonce and a proof that it holds the role's key (a
    tag over both), so a server tells a keyed client from a stranger by its first packet."""
    proof = hmac.new(key, b"hvdrunner-knock" + role + client_nonce, hashlib.sha256).digest()[:KNOCK_PROOF]
    return bytes([len(role)]) + role + client_nonce + proof


_LONGEST_KNOCK = 1 + MAX_ROLE + NONCE_BYTES + KNOCK_PROOF


def _knock_size(first: int) -> int | None:
    """How long a knock whose first byte is ``first`` is; None if no knock starts so."""
    return 1 + first + NONCE_BYTES + KNOCK_PROOF if 0 < first <= MAX_ROLE else None


def _check_knock(knock: bytes, keys: Mapping[str, bytes]) -> tuple[str, bytes, bytes]:
    """The role, its key and the client's nonce of a whole ``knock``; ``AuthenticationError`` unless
    its proof was made with the key of a role this server serves."""
    size = knock[0]
    role = knock[1:1 + size].decode("ascii", "replace")
    client_nonce, proof = knock[1 + size:1 + size + NONCE_BYTES], knock[1 + size + NONCE_BYTES:]
    key = keys.get(role)
    if key is None:
        raise AuthenticationError("a peer claiming a role this service does not serve (%r)" % role[:MAX_ROLE])
    if not hmac.compare_digest(proof, _knock(key, knock[1:1 + size], client_nonce)[-KNOCK_PROOF:]):
        raise AuthenticationError("a peer that does not hold the key of the role it claims (%r)" % role)
    return role, key, client_nonce


def connect(address: tuple[str, int], credentials: Credentials, timeout: float = 10.0) -> ClientConnection:
    """Connect and complete the handshake within ``timeout`` in all (however slowly the server
    answers); the server must prove it holds the key too."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock)
        client_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(_knock(credentials.key, credentials.role.encode(), client_nonce))
        server_nonce = bytes(_recv_exact(sock, NONCE_BYTES, deadline))
        conn = ClientConnection(sock, _session_key(credentials.key, server_nonce, client_nonce), credentials.role)
        conn._deadline, conn._max_frame = deadline, HELLO_MAX
        conn.send_bytes(_HELLO)
        if conn.recv_bytes() != _WELCOME:
            raise AuthenticationError("the server did not welcome us")
        conn._deadline, conn._max_frame = None, MAX_FRAME
        sock.settimeout(None)
        return conn
    except BaseException:
        sock.close()
        raise


def handshake(sock: socket.socket, keys: Mapping[str, bytes], timeout: float | None = None) -> ServerConnection:
    """The server's half, blocking (``Server`` reads the knock itself): nothing the peer sends is
    acted on (or read past its knock) before it proves it holds the key of a role this server
    accepts, within ``HANDSHAKE_TIMEOUT`` in all (a peer that sends a byte now and then gains no time)."""
    deadline = time.monotonic() + (timeout or HANDSHAKE_TIMEOUT)
    first = bytes(_recv_exact(sock, 1, deadline))
    size = _knock_size(first[0])
    if size is None:
        raise AuthenticationError("a malformed handshake")
    role, key, client_nonce = _check_knock(first + bytes(_recv_exact(sock, size - 1, deadline)), keys)
    return _finish_handshake(sock, role, key, client_nonce, deadline)


def _finish_handshake(sock: socket.socket, role: str, key: bytes, client_nonce: bytes,
                      deadline: float) -> ServerConnection:
    """After a good knock: the server's nonce, the client's hello under the connection's key, our welcome."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _keepalive(sock)
    server_nonce = os.urandom(NONCE_BYTES)
    _time_left(sock, deadline)
    sock.sendall(server_nonce)
    conn = ServerConnection(sock, _session_key(key, server_nonce, client_nonce), role)
    conn._deadline, conn._max_frame = deadline, HELLO_MAX
    if conn.recv_bytes() != _HELLO:
        raise AuthenticationError("a malformed hello")
    conn.send_bytes(_WELCOME)
    conn._deadline, conn._max_frame = None, MAX_FRAME
    sock.settimeout(None)
    return conn


def listen(host: str, backlog: int = 128) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(backlog)
    return sock


def stop_listening(listener: socket.socket) -> None:
    """Stop accepting now: ``shutdown`` wakes the server's loop and refuses new peers at once, then close."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        listener.close()


# accept() errors that say "not now" (no descriptors, no buffers, a peer that gave up): the loop waits and goes on
_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EPERM,
              errno.EINTR, errno.EAGAIN)
_CLOSED = (errno.EBADF, errno.EINVAL, errno.ENOTSOCK)
SEEN_KNOCKS = 65536  # the client nonces of the newest good knocks a server remembers: a replayed knock is refused


@dataclasses.dataclass
class _Unproven:
    """A connection whose knock has not come whole yet."""

    source: str
    deadline: float
    knock: bytearray = dataclasses.field(default_factory=bytearray)


class Server:
    """Accepts connections on ``listener`` until it is closed.

    Admission is by the client's first packet (its knock: role, nonce and a proof made with the
    role's key), read by one thread for every connection that has not proven anything yet: such a
    connection costs a descriptor and a few bytes, never a thread. At most ``max_unproven`` of them
    are held, each for at most ``HANDSHAKE_TIMEOUT``; when a new one comes the oldest is closed. A
    keyed client's knock comes with its first packet, so it is read long before the strangers that
    came after it could push it out, however many addresses they use. Only then does a connection
    get a thread of its own (at most ``max_connections`` in all; at most ``pending_per_role(role)``
    of one role in the rest of their handshake) to finish the handshake and be served. A knock's
    nonce is accepted once (a recorded knock replayed gets nothing). The loop survives running out
    of file descriptors and any error of a single connection.
    """

    def __init__(self, listener: socket.socket, keys: Mapping[str, bytes], handle: Callable[[ServerConnection], None],
                 name: str, *, max_connections: int = 1024, max_unproven: int = 256,
                 pending_per_role: Callable[[str], int | None] = lambda role: None,
                 on_reject: Callable[[BaseException], None] | None = None) -> None:
        self._listener = listener
        self._keys = keys
        self._handle = handle
        self._name = name
        self._all = threading.BoundedSemaphore(max_connections)
        self._max_unproven = max_unproven
        self._pending_per_role = pending_per_role
        self._pending_of: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._unproven: collections.OrderedDict[socket.socket, _Unproven] = collections.OrderedDict()
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._selector = selectors.DefaultSelector()
        self._on_reject = on_reject or (lambda err: None)
        self.turned_away = 0
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while self._listener.fileno() >= 0:
                accept = False
                for key, _ in self._selector.select(0.25):
                    if key.fileobj is self._listener:
                        accept = True
                    else:
                        self._read_knock(key.fileobj)  # knocks first: they came before the next strangers
                if accept and not self._accept():
                    return
                self._expire()
        except (OSError, ValueError):
            return  # the listener went away under the selector
        finally:
            for sock in list(self._unproven):
                self._drop(sock)
            self._selector.close()

    def _accept(self) -> bool:
        """Take what the kernel holds (a bounded burst); False once the listener is closed."""
        for _ in range(max(1, self._max_unproven // 2)):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return True
            except OSError as err:
                if self._listener.fileno() < 0 or err.errno in _CLOSED:
                    return False
                if err.errno in (errno.EMFILE, errno.ENFILE) and self._unproven:
                    self._drop(next(iter(self._unproven)), turned_away=True)  # a descriptor for whoever comes
                elif err.errno in _TRANSIENT:
                    time.sleep(0.05)
                else:
                    log.warning("%s: accept failed (%s); still listening", self._name, err)
                    time.sleep(0.05)
                return True
            if len(self._unproven) >= self._max_unproven:
                self._drop(next(iter(self._unproven)), turned_away=True)
            sock.setblocking(False)
            self._unproven[sock] = _Unproven(str(peer[0]), time.monotonic() + HANDSHAKE_TIMEOUT)
            self._selector.register(sock, selectors.EVENT_READ)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._unproven:
            sock, unproven = next(iter(self._unproven.items()))
            if unproven.deadline > now:
                return
            self._drop(sock)

    def _forget(self, sock: socket.socket) -> None:
        """``sock`` is no longer waited on for its knock."""
        self._unproven.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)

    def _drop(self, sock: socket.socket, *, turned_away: bool = False) -> None:
        self._forget(sock)
        with contextlib.suppress(OSError):
            sock.close()
        if turned_away:
            self.turned_away += 1

    def _read_knock(self, sock: socket.socket) -> None:
        unproven = self._unproven.get(sock)
        if unproven is None:
            return
        knock = unproven.knock
        try:
            got = sock.recv((_knock_size(knock[0]) or 0) - len(knock) if knock else _LONGEST_KNOCK)
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:
            self._drop(sock)  # a peer that went away before its knock
            return
        knock += got
        size = _knock_size(knock[0])
        try:
            if size is None or len(knock) > size:  # nothing follows a knock before the server's nonce
                raise AuthenticationError("a malformed handshake")
            if len(knock) < size:
                return
            role, key, client_nonce = _check_knock(bytes(knock), self._keys)
            if client_nonce in self._seen:
                raise AuthenticationError("a knock seen before (replayed) for role %r" % role)
        except AuthenticationError as err:
            self._drop(sock)
            self._on_reject(err)
            return
        self._forget(sock)
        self._remember(client_nonce)
        if not self._admit(role):
            self.turned_away += 1
            with contextlib.suppress(OSError):
                sock.close()
            return
        sock.setblocking(True)
        try:
            threading.Thread(target=self._one, args=(sock, role, key, client_nonce, unproven.deadline),
                             name=self._name, daemon=True).start()
        except RuntimeError:  # no thread to be had
            self._end_pending(role)
            self._all.release()
            with contextlib.suppress(OSError):
                sock.close()

    def _remember(self, client_nonce: bytes) -> None:
        self._seen[client_nonce] = None
        if len(self._seen) > SEEN_KNOCKS:
            self._seen.popitem(last=False)

    def _admit(self, role: str) -> bool:
        """Room for one more connection of ``role`` in the rest of its handshake: both limits hold."""
        if not self._all.acquire(blocking=False):
            return False
        most = self._pending_per_role(role)
        with self._count_lock:
            if most is None or self._pending_of[role] < most:
                self._pending_of[role] += 1
                return True
        self._all.release()
        return False

    def _end_pending(self, role: str) -> None:
        with self._count_lock:
            self._pending_of[role] -= 1
            if not self._pending_of[role]:
                del self._pending_of[role]

    def _one(self, sock: socket.socket, role: str, key: bytes, client_nonce: bytes, deadline: float) -> None:
        pending = True
        try:
            try:
                conn = _finish_handshake(sock, role, key, client_nonce, deadline)
            except AuthenticationError as err:
                self._on_reject(err)
                return
            except (OSError, ValueError):
                return  # a peer that went away or never finished its hello
            self._end_pending(role)
            pending = False
            try:
                self._handle(conn)
            except Exception as err:  # noqa: BLE001 - one connection's bug must not end the service
                log.warning("%s: a connection ended with %s: %s", self._name, type(err).__name__, err)
            finally:
                conn.close()
        finally:
            if pending:
                self._end_pending(role)
            self._all.release()
            with contextlib.suppress(OSError):
                sock.close()


REFUSAL_LOG_INTERVAL_S = 10.0  # at most one word about refused connections this often


class RefusalLog:
    """Says why a connection was refused at most once per ``REFUSAL_LOG_INTERVAL_S``, with how many
    went unsaid since: peers without a key cannot flood a log."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._lock = threading.Lock()
        self._quiet_until = 0.0
        self._unsaid = 0

    def note(self, err: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._quiet_until:
                self._unsaid += 1
                return
            self._quiet_until = now + REFUSAL_LOG_INTERVAL_S
            unsaid, self._unsaid = self._unsaid, 0
        self._say("%s%s" % (err, " (and %d more refused since the last word)" % unsaid if unsaid else ""))


def serve(listener: socket.socket, keys: Mapping[str, bytes], handle: Callable[[ServerConnection], None], name: str,
          **limits: Any) -> Server:
    """Serve authenticated connections on ``listener`` (see ``Server``)."""
    return Server(listener, keys, handle, name, **limits)
