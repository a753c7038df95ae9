"""Rank 0's side of durable checkpoints: notice a complete checkpoint, ship it to the driver in
the background, coalesce what comes faster than the link.

When a version is complete (the rule of ``runtime.checkpoint_dir()``):

* a file is renamed into the folder (or a subfolder) from a temporary name, or written under a
  final name and closed (inotify; a folder that looks unchanged for one poll where inotify is
  missing); or
* once the run has called ``runtime.commit_checkpoint()``, only its calls make versions: each
  call hard-links the folder as it is into ``commits/<n>`` in the task folder. That switch is never
  silent: a file completed after it that no call takes within ``UNCOMMITTED_WARN_S`` (or by the
  task's end) is named in a warning on the driver (``uncommitted_warning``).

One thread in rank 0's barrier task (``ship_checkpoints``) hard-links the changed files into the
task's ``outbox`` and sends them over the run's authenticated channel (``put-version``), one
version at a time. What completes meanwhile is coalesced: one pending commit at most, replaced
by a newer one, and the live folder is read again only when the outbox is free. Hard links cost
no disk until training replaces a file, so rank 0's host holds the live folder and at most the
version in flight. A file rewritten in place while it travels is caught (its size or mtime moved)
and that version is dropped, never committed half-old, half-new.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import names, wire
from airflow_provider_horovod.runner.hardlinks import link_tree
from airflow_provider_horovod.runner.transfer import in_progress, put_version
from airflow_provider_horovod.runner.messages import PutVersion
from airflow_provider_horovod.runner.records import CommitRequest

log = logging.getLogger(__name__)

POLL_S = 0.2
UNCOMMITTED_WARN_S = 30.0  # how long a save may stay in no version, in a run that calls commit_checkpoint, before rank 0's task says so
STOP_WAIT_S = 0.5  # at the run's end, how long a version in flight may still finish (the final hand-over has it all)
Stat = tuple[int, int, int]  # size, mtime_ns, inode


def file_stats(folder: Path) -> dict[str, Stat]:
    """Every finished regular file under ``folder`` (the rule's final names), links not followed."""
    found: dict[str, Stat] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not in_progress(d) and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            if in_progress(name) or name == CommitRequest.FILE:
                continue
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if os.path.isfile(path) and not os.path.islink(path):
                    found[os.path.relpath(path, folder).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return found


# -- runtime.commit_checkpoint ------------------------------------------------------------------
def request_commit(task: names.TaskDir, folder: Path, request: CommitRequest) -> None:
    """Rank 0's call: the folder as it is now is one version. Replaces a commit not yet taken.

    It keeps rank 0 only as long as linking the files takes (O(files), whatever their size): a
    replaced snapshot is renamed aside (``.stale-<n>``, a name the shipper never takes) and removed
    by a thread, because removing it can free the last link of a file training has since replaced,
    which the kernel frees in the unlink (~0.2 ms per MiB here). Where the file system refuses hard
    links, ``link_tree`` copies, and the call takes as long as the copy."""
    commits = task.path / names.COMMITS_DIR
    commits.mkdir(exist_ok=True)
    number = time.monotonic_ns()
    building = commits / (".%d" % number)
    link_tree(folder, building, sorted(file_stats(folder)))
    (building / CommitRequest.FILE).write_text(json.dumps(request.to_json()))
    os.rename(building, commits / ("%020d" % number))
    stale = []
    for older in commits.iterdir():
        if older.name.isdigit() and int(older.name) < number:
            with contextlib.suppress(OSError):  # the shipper may have taken it meanwhile
                os.rename(older, commits / (".stale-%s" % older.name))
                stale.append(commits / (".stale-%s" % older.name))
    if stale:
        threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in stale],
                         name="hvdrunner-commit-cleanup", daemon=True).start()


# -- watching the folder ------------------------------------------------------------------------
_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE, _IN_ISDIR = 0x8, 0x80, 0x100, 0x40000000
_EVENT = struct.Struct("iIII")


class FolderWatch:
    """Says when a checkpoint completed in a folder: inotify where Linux has it, else a poll."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fd = -1
        self._last = file_stats(folder)
        self._woken = threading.Event()
        self._wake_lock = threading.Lock()  # wake() comes from another thread than close()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # wake(): a wait ends at once
        with contextlib.suppress(OSError, AttributeError):
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd >= 0:
            self._watch_tree(folder)

    def _watch_tree(self, folder: Path) -> None:
        for dirpath, dirnames, _ in os.walk(folder):
            self._libc.inotify_add_watch(self._fd, os.fsencode(dirpath), _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE)
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]

    def wait(self, timeout: float) -> bool:
        """True when a checkpoint completed since the last call (within ``timeout``)."""
        if self._fd < 0:
            return self._poll(timeout)
        ready, _, _ = select.select([self._fd, self._wake_r], [], [], timeout)
        if self._fd not in ready:
            return False
        completed = False
        with contextlib.suppress(BlockingIOError):
            while True:
                data = os.read(self._fd, 65536)
                completed |= self._events(data)
        return completed

    def _events(self, data: bytes) -> bool:
        completed = False
        offset = 0
        while offset + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0").decode(errors="replace")
            offset += _EVENT.size + length
            if mask & _IN_ISDIR and mask & (_IN_CREATE | _IN_MOVED_TO):
                self._watch_new_dirs()
            if mask & (_IN_CLOSE_WRITE | _IN_MOVED_TO) and name and not in_progress(name):
                completed = True
        return completed

    def _watch_new_dirs(self) -> None:
        self._watch_tree(self.folder)  # adding a watch again is harmless (the kernel returns the same one)

    def wake(self) -> None:
        """End the current (and any later) ``wait`` at once: the shipper is stopping."""
        self._woken.set()
        with self._wake_lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:  # closed already: no later wait
                os.write(self._wake_w, b"x")

    def _poll(self, timeout: float) -> bool:
        self._woken.wait(timeout)
        now = file_stats(self.folder)
        changed, self._last = now != self._last, now
        return changed and now == file_stats(self.folder)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1


def uncommitted_warning(files: list[str], waited_s: float | None, newest_step: int | None) -> str:
    """What rank 0's task says when, in a run that calls ``commit_checkpoint()``, ``files`` were saved
    ``waited_s`` ago (``None``: the task ends) and no call has made them a version."""
    shown = ", ".join(files[:5]) + (", ... (%d files)" % len(files) if len(files) > 5 else "")
    newest = "the version committed at step %s" % newest_step if newest_step is not None else "its newest version"
    if waited_s is None:
        when, then = ("and the attempt ends without a runtime.commit_checkpoint() call after it",
                      "only the attempt's final hand-over (checkpoints/) brings it back; a restart resumes from %s"
                      % newest)
    else:
        when, then = ("%.0f s ago and has not called runtime.commit_checkpoint() since" % waited_s,
                      "a restart or a retry resumes from %s" % newest)
    return ("WARNING: rank 0 saved %s in runtime.checkpoint_dir() %s. This run calls commit_checkpoint(), so only its "
            "calls make checkpoint versions and no version holds this save: %s. Call runtime.commit_checkpoint() "
            "after each save (docs/runtime.md, the commit rule)." % (shown, when, then))


# -- shipping -----------------------------------------------------------------------------------
class Shipper(threading.Thread):
    """Ships rank 0's checkpoint versions to the driver, one at a time, until ``stop``."""

    def __init__(self, channel: tuple[str, int], secret: bytes, task: names.TaskDir,
                 say: Callable[[str], None] | None = None) -> None:
        super().__init__(name="hvdrunner-checkpoint-shipper", daemon=True)
        self._say = say or (lambda text: log.warning("%s", text))  # a warning that must reach the driver's log
        self._committed: dict[str, Stat] = {}  # the files of the newest commit_checkpoint snapshot
        self._newest_step: int | None = None
        self._saved_at: float | None = None  # a file completed after the newest snapshot (monotonic)
        self._warned = False
        self.task = task
        self.folder = task.artifacts / names.CHECKPOINTS_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.outbox = task.path / names.OUTBOX_DIR
        self._channel, self._secret = channel, secret
        self._watch = FolderWatch(self.folder)
        self._stopping = threading.Event()
        self._base: dict[str, Stat] = {}  # what the driver's newest version holds
        self.shipped = 0
        self.errors: list[str] = []
        self._conn: wire.ClientConnection | None = None  # the version in flight

    def run(self) -> None:
        dirty = False
        while not self._stopping.is_set():
            dirty |= self._watch.wait(POLL_S)
            commit = self._take_commit()
            if commit is not None:
                dirty = False  # the snapshot holds every file completed before the call
                self._ship_commit(commit)
            elif dirty and not self._explicit():
                dirty = False
                self._ship_folder()
            elif dirty:
                dirty = False
                self._saved_at = self._saved_at or time.monotonic()
            self._check_uncommitted(time.monotonic(), ending=False)
        self._watch.close()

    def stop(self) -> None:
        """A version still in flight after ``STOP_WAIT_S`` is cut off: the final hand-over carries
        the same files, and two transfers would share the link (each at half its rate)."""
        self._stopping.set()
        self._watch.wake()  # not a poll's interval later
        self.join(STOP_WAIT_S)
        if self.is_alive() and self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)
            self.join(STOP_WAIT_S)
        self._check_uncommitted(time.monotonic(), ending=True)

    def _uncommitted(self) -> list[str]:
        """The finished files of the live folder that the newest ``commit_checkpoint`` snapshot (one
        not yet taken included) lacks or holds otherwise (a file deleted since loses nothing)."""
        committed = self._committed
        with contextlib.suppress(OSError):
            pending = sorted(p for p in (self.task.path / names.COMMITS_DIR).iterdir() if p.name.isdigit())
            committed = file_stats(pending[-1]) if pending else committed
        return sorted(rel for rel, st in file_stats(self.folder).items() if committed.get(rel) != st)

    def _check_uncommitted(self, now: float, *, ending: bool) -> None:
        """Once per attempt: say so when a run that calls ``commit_checkpoint`` saved files that no
        call took within ``UNCOMMITTED_WARN_S``, or by the task's end."""
        if self._warned or not self._explicit():
            return
        if not ending and (self._saved_at is None or now - self._saved_at < UNCOMMITTED_WARN_S):
            return
        files = self._uncommitted()
        if not files:
            self._saved_at = None
            return
        self._warned = True
        self._say(uncommitted_warning(files, None if ending else now - self._saved_at, self._newest_step))

    def _explicit(self) -> bool:
        return (self.task.path / names.COMMITS_DIR).is_dir()

    def _take_commit(self) -> CommitRequest | None:
        """The newest pending ``commit_checkpoint`` snapshot, moved into the outbox; older ones dropped."""
        commits = self.task.path / names.COMMITS_DIR
        with contextlib.suppress(OSError, ValueError):
            pending = sorted(p for p in commits.iterdir() if p.name.isdigit())
            if pending:
                for older in pending[:-1]:
                    shutil.rmtree(older, ignore_errors=True)
                os.rename(pending[-1], self.outbox)
                request = CommitRequest.from_json(json.loads((self.outbox / CommitRequest.FILE).read_text()))
                (self.outbox / CommitRequest.FILE).unlink()
                self._committed, self._newest_step, self._saved_at = file_stats(self.outbox), request.step, None
                return request
        return None

    def _changed(self, stats: dict[str, Stat]) -> list[str]:
        return sorted(rel for rel, st in stats.items() if self._base.get(rel) != st)

    def _ship_folder(self) -> None:
        """The rename rule: the folder's finished files as they are now; only the changed ones travel."""
        stats = file_stats(self.folder)
        if not self._changed(stats) and set(stats) == set(self._base):
            return
        link_tree(self.folder, self.outbox, self._changed(stats))
        self._ship(CommitRequest(time=time.time()), stats)

    def _ship_commit(self, request: CommitRequest) -> None:
        """A ``commit_checkpoint`` snapshot: every file it holds, the unchanged ones dropped before sending."""
        stats = file_stats(self.outbox)
        for rel in set(stats) - set(self._changed(stats)):
            os.unlink(self.outbox / rel)
        self._ship(request, stats)

    def _ship(self, request: CommitRequest, stats: dict[str, Stat]) -> None:
        """One version over the channel: the header, the changed files (copied by the driver when it
        sees this folder, else streamed), then whether they stayed as they were while they travelled."""
        sent = {rel: stats[rel][:2] for rel in self._changed(stats)}
        version = PutVersion(step=request.step, metrics=dict(request.metrics),
                             manifest={rel: st[0] for rel, st in stats.items()})
        try:
            put_version(self._channel, self._secret, version, self.outbox, self.task.path,
                        intact=lambda: {rel: st[:2] for rel, st in file_stats(self.outbox).items()} == sent,
                        opened=self._opened)
            self._base = stats
            self.shipped += 1
        except (OSError, ValueError, wire.ProtocolError) as err:
            if not self._stopping.is_set():  # cut off at the end: the final hand-over has it all
                self.errors.append(str(err))
                log.warning("A checkpoint version did not reach the driver: %s", err)
        finally:
            self._conn = None
            shutil.rmtree(self.outbox, ignore_errors=True)

    def _opened(self, conn: wire.ClientConnection) -> None:
        self._conn = conn


@contextlib.contextmanager
def ship_checkpoints(spec: Any, task: names.TaskDir, *, rank0: bool,
                     say: Callable[[str], None] | None = None) -> Iterator[Shipper | None]:
    """On rank 0's task, checkpoint versions go to the driver while the body runs (a ``RunSpec``
    that collects artifacts over a channel; nothing otherwise). ``say``: how a warning of the
    shipper's reaches the driver's log (this process's log by default)."""
    if not (rank0 and spec.collect_artifacts and spec.channel is not None):
        yield None
        return
    shipper = Shipper(spec.channel, spec.secret, task, say)
    shipper.start()
    try:
        yield shipper
    finally:
        shipper.stop()
