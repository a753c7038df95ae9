"""File transfers between the run's processes: rank 0's checkpoints and timeline to the driver,
checkpoint versions while training runs, ``resume_from`` to every host.

Both sides of every transfer live here: the side with the files (``offer_tree``: rank 0's task
with its artifacts, ``upload_tree``, or a checkpoint version, ``put_version``; the driver with
``resume_from``) and the side that takes them (``take_tree``: the driver's channel, or a host
leader, ``fetch_resume``). Their frames are in ``messages.py``.

Files move as a stream of frames over the run's authenticated channel (``send_tree`` /
``receive_tree``): the kernel sends each chunk from the file's pages, and the receiver holds one
256 KiB piece of it at a time. When rank 0's task runs on the driver's own host
(``local[N]``, a single-machine cluster, or a folder on storage both see), the task offers its folder
instead: it writes a random token to a private file and sends the file's path and the token over
the channel. Only a driver that reads the same token at that path, so sees the same files as the
same user, copies them itself, in the kernel (``copy_tree``); any other answer falls back to the
stream. Either way the files land in a staging folder inside ``artifact_dir``, and the driver
commits them (``driver/artifact_dir.py``). Folders are walked by descriptor, no link followed.

The rule training code follows: write a checkpoint under a temporary name (``*.tmp``, or a name
starting with ``.``) and rename it when it is complete. Such files are never pulled, so a
checkpoint being written when the run fails is never offered as complete (``in_progress``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.messages import (
    FetchResume,
    FileHeader,
    Heartbeat,
    Intact,
    Message,
    Mode,
    Offer,
    PutArtifacts,
    PutVersion,
    Receipt,
    Received,
    StreamEnd,
    TransferError,
    wait_for,
)

CHUNK = 4 << 20
COPY_CHUNK = 64 << 20  # per copy_file_range call: how often a same-host copy looks for a cancel
TRANSFER_TIMEOUT_S = 60.0  # a transfer's peer sends a frame or a heartbeat well within this


def in_progress(name: str) -> bool:
    """A file that is still being written by the rule above."""
    return name.startswith((".", "~")) or name.endswith((".tmp", ".partial", ".part"))


# -- walking a folder without following links ----------------------------------------------------
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
OPEN_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


def open_dir(path: Path) -> int:
    """A descriptor of the folder ``path`` itself: never of what a link there points to."""
    return os.open(path, OPEN_DIR)


def finished_files(root_fd: int, *, owner: int | None = None) -> Iterator[tuple[str, int]]:
    """``(relative path, open descriptor)`` of every finished regular file under the folder
    ``root_fd``, in a stable order. Links are never followed (a link, a FIFO, a device is skipped),
    and with ``owner`` only files that user owns are opened. The caller closes each descriptor."""
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not in_progress(d))
        for name in sorted(filenames):
            if in_progress(name):
                continue
            try:
                fd = os.open(name, OPEN_FILE, dir_fd=dir_fd)
            except OSError:
                continue  # a link (ELOOP), or removed while we looked
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
                os.close(fd)
                continue
            os.set_blocking(fd, True)
            yield os.path.normpath(os.path.join(dirpath, name)), fd


def _tree_fd(root: Path | None) -> int | None:
    if root is None:
        return None
    try:
        return open_dir(root)
    except OSError:
        return None  # not there (nothing was written), or a link: nothing to send


# -- streaming ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
    """The most one transfer may bring: a full disk on the driver is not the run's to cause."""

    max_bytes: int = 1 << 40
    max_files: int = 100_000


def send_tree(conn, root: Path | None) -> int:
    """Send every finished file under ``root``; return how many bytes were sent. Each chunk is tagged
    over the file's pages and sent by the kernel (``wire.FramedConnection.send_file``)."""
    sent = count = 0
    root_fd = _tree_fd(root)
    scratch = wire.scratch()
    try:
        for rel, fd in (finished_files(root_fd) if root_fd is not None else ()):
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                conn.send(FileHeader(rel, size).to_json())
                count += 1
                for offset in range(0, size, CHUNK):
                    conn.send_file(f, offset, min(CHUNK, size - offset), scratch)
                sent += size
    finally:
        if root_fd is not None:
            os.close(root_fd)
    conn.send(StreamEnd(count).to_json())
    return sent


class RefusedError(OSError):
    """The receiver took the offer and said no, with its reason (past a limit, its disk full): it
    knows and records why, so the sender need not report it again."""


def receive_tree(conn, dest: Path, limits: Limits = Limits()) -> list[dict[str, Any]]:
    """Receive what ``send_tree`` sends into ``dest``; files appear only when whole and verified.

    Every name must stay inside ``dest``, every file must be exactly its declared size, and the
    transfer must stay inside ``limits``; anything else is a ``TransferError``. A chunk goes to
    ``<name>.partial`` as it arrives and counts once its tag is checked at its end; a chunk that
    fails the check fails the transfer, and that partial file is removed, never renamed into place.
    """
    received = []
    total = 0
    dest.mkdir(parents=True, exist_ok=True)
    scratch = wire.scratch()
    while True:
        raw = conn.recv()
        if StreamEnd.is_one(raw):
            return received
        head = FileHeader.from_json(raw)
        rel, size = PurePosixPath(head.file), head.size
        if len(received) + 1 > limits.max_files:
            raise TransferError("rank 0's artifacts hold more than %d files (max_artifact_files); keep fewer "
                                "files in the checkpoint folder or raise the limit" % limits.max_files)
        total += size
        if total > limits.max_bytes:
            raise TransferError("rank 0's artifacts are larger than %d bytes (max_artifact_bytes); keep smaller "
                                "checkpoints or raise the limit" % limits.max_bytes)
        target = dest.joinpath(*rel.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        _receive_file(conn, rel, size, target, scratch)
        received.append({"path": rel.as_posix(), "size": size})


def _receive_file(conn, rel: PurePosixPath, size: int, target: Path, scratch: memoryview) -> None:
    """One file's chunks into ``target.partial``, renamed to ``target`` when all of them verified;
    removed on any failure."""
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as out:
            left = size
            while left > 0:
                try:
                    left -= conn.recv_frame_to(out.write, left, scratch)
                except wire.FrameTooLarge as err:
                    raise TransferError("%s is larger than the %d bytes it declared" % (rel, size)) from err
                except wire.AuthenticationError as err:
                    raise wire.AuthenticationError("a chunk of %s failed verification (%s); its partial file is "
                                                   "removed" % (rel, err)) from err
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


# -- same-host copy -------------------------------------------------------------------------------
# The side with the files writes a random token into a new private file next to them and sends
# the file's path and the token; the taker copies the files itself only if it reads that token
# there, from a regular file it owns, in a folder it owns that only it can read. A taker that sees
# the same files as the same user could have been sent them anyway: nothing is gained by lying.
PROOF_PREFIX = "offer-"


def make_offer(root: Path, proof_dir: Path) -> dict[str, str]:
    """Offer ``root`` to a taker that may see it: a random token in a file only this user can read."""
    token = secrets.token_hex(32)
    proof = proof_dir / ("%s%s" % (PROOF_PREFIX, secrets.token_hex(8)))
    fd = os.open(proof, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return {"root": str(root.absolute()), "proof": str(proof.absolute()), "token": token}


def open_dir_strictly(path: Path) -> int:
    """A descriptor of the folder at the absolute ``path``, reached from ``/`` one component at a
    time without following a link on any of them (``OSError`` if one is a link)."""
    return open_below(os.open("/", OPEN_DIR), path.parts[1:])


def open_below(fd: int, parts: Iterable[str]) -> int:
    """A descriptor of the folder ``parts`` below the open folder ``fd`` (which this closes), one
    component at a time, following no link (``OSError`` if one is a link or missing)."""
    try:
        for part in parts:
            child = os.open(part, OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _private_dir(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a folder (no link on the way) this user owns and only it can enter."""
    try:
        fd = open_dir_strictly(path)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


def _read_proof(dir_fd: int, name: str, token: str) -> bool:
    try:
        fd = os.open(name, OPEN_FILE, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_size != len(token):
            return False
        seen = os.read(fd, len(token) + 1)
    finally:
        os.close(fd)
    return hmac.compare_digest(seen, token.encode())


def open_offer(offer: Any, *, root_ok: Callable[[Path], bool] = lambda root: True,
               proof_beside_root: bool = False) -> int | None:
    """A descriptor of the offered folder if this process reads the offer's token at its proof path;
    else ``None``. The caller closes it.

    ``root_ok``: which folders this taker accepts at all. ``proof_beside_root``: the proof must be
    in the folder that holds ``root`` (a barrier task's own folder), which must be private to this
    user and reached without a link on any component; ``root`` is then opened from that folder's
    descriptor, so the folder copied is the one the proof was read in, whatever a path says later.
    """
    if not isinstance(offer, dict):
        return None
    root, proof, token = offer.get("root"), offer.get("proof"), offer.get("token")
    if not (isinstance(root, str) and isinstance(proof, str) and isinstance(token, str)) or len(token) < 32:
        return None
    if not (os.path.isabs(root) and os.path.isabs(proof)) or "\0" in root + proof + token:
        return None
    root_path, proof_path = Path(os.path.normpath(root)), Path(os.path.normpath(proof))
    if not proof_path.name.startswith(PROOF_PREFIX) or not root_ok(root_path):
        return None
    if proof_beside_root and proof_path.parent != root_path.parent:
        return None
    folder = _private_dir(proof_path.parent) if proof_beside_root else _open_dir_or_none(proof_path.parent)
    if folder is None:
        return None
    try:
        if not _read_proof(folder, proof_path.name, token):
            return None
        if not proof_beside_root:
            return _open_dir_or_none(root_path)
        with contextlib.suppress(OSError):
            os.unlink(proof_path.name, dir_fd=folder)  # used once
        try:
            return os.open(root_path.name, OPEN_DIR, dir_fd=folder)
        except OSError:
            return None
    finally:
        os.close(folder)


def _open_dir_or_none(path: Path) -> int | None:
    try:
        return open_dir(path)
    except OSError:
        return None


def _copy_step(how: str, src: int, dst: int) -> int:
    if how == "copy_file_range":
        return os.copy_file_range(src, dst, COPY_CHUNK)
    if how == "sendfile":
        return os.sendfile(dst, src, None, COPY_CHUNK)
    return os.write(dst, os.read(src, CHUNK))


# In the kernel first; each step down is taken when a file system or kernel refuses the one above.
_COPY_WAYS = [w for w in ("copy_file_range", "sendfile") if hasattr(os, w) and sys.platform == "linux"] + ["read"]
_CANNOT_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


def _copy_fd(src: int, dst: int, cancelled: Callable[[], bool], progress: Callable[[int], None]) -> int:
    """Copy ``src`` to ``dst`` from their current positions to the end; return the bytes copied."""
    ways = list(_COPY_WAYS)
    done = 0
    while True:
        if cancelled():
            raise ConnectionAbortedError("the run ended while its artifacts were being copied")
        try:
            n = _copy_step(ways[0], src, dst)
        except OSError as err:
            if len(ways) == 1 or err.errno not in _CANNOT_COPY:
                raise
            ways.pop(0)
            continue
        if not n:
            return done
        done += n
        progress(done)


def copy_tree(root_fd: int, dest: Path, *, cancelled: Callable[[], bool] = lambda: False,
              progress: Callable[[int], None] = lambda done: None, limits: Limits = Limits(),
              owner: int | None = None) -> list[dict[str, Any]]:
    """Copy every finished regular file under the folder ``root_fd`` (closed when done) into
    ``dest`` (links are never followed; with ``owner``, only that user's files); files appear only
    when whole."""
    received = []
    total = 0
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for rel, fd in finished_files(root_fd, owner=owner):
            with os.fdopen(fd, "rb") as src:
                total += os.fstat(src.fileno()).st_size
                if len(received) + 1 > limits.max_files or total > limits.max_bytes:
                    raise TransferError("rank 0's artifacts are past the limit of %d files / %d bytes "
                                        "(max_artifact_files / max_artifact_bytes)" % (limits.max_files, limits.max_bytes))
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(target.name + ".partial")
                with partial.open("wb") as out:
                    size = _copy_fd(src.fileno(), out.fileno(), cancelled, progress)
            os.replace(partial, target)
            received.append({"path": PurePosixPath(rel).as_posix(), "size": size})
    finally:
        os.close(root_fd)
    return received


# -- one transfer, either direction ---------------------------------------------------------------
def offer_tree(conn, root: Path | None, proof_dir: Path | None) -> None:
    """The side that has the files: offer ``root`` (``proof_dir=None``: stream only; ``root=None``:
    an empty stream), stream it if asked, and wait for the taker's receipt; heartbeats and anything
    else before it are ignored."""
    give_tree(conn, root, proof_dir)
    receipt = wait_for(conn, Receipt)
    if not receipt.ok:
        raise RefusedError(receipt.error or "the receiver could not store the files")


def give_tree(conn, root: Path | None, proof_dir: Path | None) -> None:
    """Offer ``root`` and stream it if the taker asks (``offer_tree`` without waiting for the receipt)."""
    offer = None
    if root is not None and proof_dir is not None:
        with contextlib.suppress(OSError):  # no proof file (disk full, read-only): the stream still works
            offer = make_offer(root, proof_dir)
    conn.send(Offer(offer).to_json())
    if Mode.from_json(conn.recv()).stream:
        send_tree(conn, root)


def take_tree(conn, dest: Path, *, allow_copy: bool = True, cancelled: Callable[[], bool] = lambda: False,
              chosen: Callable[[str], None] = lambda mode: None, root_ok: Callable[[Path], bool] | None = None,
              limits: Limits = Limits()) -> tuple[str, list[dict[str, Any]]]:
    """The side that wants the files: copy them if the offer proves this process sees them, else
    have them streamed. ``root_ok``: the folders this side accepts to copy from, whose proof must
    lie beside them (the driver taking a task's artifacts); without it, any folder the offer
    proves. ``chosen`` hears the way taken before any file moves. Returns the way and the files;
    the receipt is the caller's to send."""
    offer = Offer.from_json(conn.recv()).offer
    local = None
    if allow_copy:
        local = open_offer(offer, root_ok=root_ok, proof_beside_root=True) if root_ok else open_offer(offer)
    mode = "copy" if local is not None else "stream"
    chosen(mode)
    conn.send(Mode(mode).to_json())
    if local is None:
        return mode, receive_tree(conn, dest, limits)
    beat = [time.monotonic()]

    def heartbeat(_done: int) -> None:  # the offering side waits for the receipt meanwhile
        if time.monotonic() - beat[0] > 2:
            conn.send(Heartbeat().to_json())
            beat[0] = time.monotonic()

    return mode, copy_tree(local, dest, cancelled=cancelled, progress=heartbeat, limits=limits, owner=os.geteuid())


# -- the task's requests, each on a connection of its own -----------------------------------------
@contextlib.contextmanager
def transfer_connection(channel: tuple[str, int], secret: bytes, request: Message) -> Iterator[wire.ClientConnection]:
    """A task's connection to the driver's channel for one transfer, opened with ``request``."""
    conn = wire.connect(channel, wire.Credentials.of(secret, wire.ROLE_TASK), timeout=10)
    try:
        conn.sock.settimeout(TRANSFER_TIMEOUT_S)  # the driver answers, or sends a heartbeat, well within this
        conn.send(request.to_json())
        yield conn
    finally:
        conn.close()


def upload_tree(channel: tuple[str, int], secret: bytes, root: Path, proof_dir: Path) -> None:
    """Rank 0's task: hand ``root`` (its artifacts) to the driver, copied or streamed (``put``)."""
    with transfer_connection(channel, secret, PutArtifacts()) as conn:
        offer_tree(conn, root, proof_dir)


def fetch_resume(channel: tuple[str, int], secret: bytes, dest: Path, partition: int) -> None:
    """Copy the driver's ``resume_from`` folder to ``dest`` on this host (in the kernel if this host is
    the driver's); ``partition``: this host's leader, the only one of its host the driver serves, once."""
    with transfer_connection(channel, secret, FetchResume(partition)) as conn:
        _mode, files = take_tree(conn, dest)
        conn.send(Receipt(True, files=len(files)).to_json())


def put_version(channel: tuple[str, int], secret: bytes, version: PutVersion, outbox: Path, proof_dir: Path,
                intact: Callable[[], bool], opened: Callable[[wire.ClientConnection], None] = lambda conn: None) -> None:
    """Rank 0's task: one checkpoint version (the changed files in ``outbox``), copied by the driver
    or streamed, then whether the files stayed as they were while they travelled (``intact()``);
    ``OSError`` if the driver did not commit it. ``opened`` is told the connection (to cut it off)."""
    with transfer_connection(channel, secret, version) as conn:
        opened(conn)
        give_tree(conn, outbox, proof_dir)
        wait_for(conn, Received)  # heartbeats while the driver copies
        conn.send(Intact(intact()).to_json())
        receipt = wait_for(conn, Receipt)
        if not receipt.ok:
            raise OSError(receipt.error or "the driver did not commit the version")
