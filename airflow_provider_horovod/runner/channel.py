"""The driver-side channel: an authenticated stream of log lines and events from tasks and ranks.

The driver listens on its Spark address; tasks and ranks connect with the run's secret
(``wire``). Everything sent is small JSON: ``logs`` (a batch of lines of one rank), ``event``
(task started, orted launched, ...) and ``error`` (a rank's exception, traceback and last lines).
Where executors cannot reach the driver (a Spark Connect session to a remote server), clients give
up quietly and the same information travels back in the barrier stage's result rows instead.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import wire

log = logging.getLogger(__name__)
rank_log = logging.getLogger("airflow_provider_horovod.ranks")

TAIL_LINES = 100


class Channel:
    """Accepts authenticated connections and collects what they send."""

    def __init__(
        self,
        secret: bytes,
        *,
        emit_logs: bool = True,
        artifact_staging: Path | None = None,
        resume_root: Path | None = None,
    ) -> None:
        self._secret = secret
        self._artifact_staging = artifact_staging
        self._resume_root = resume_root
        self.upload_started = threading.Event()
        self.upload_done = threading.Event()
        self.upload_error: BaseException | None = None
        self.received: list[dict[str, Any]] = []
        self.done: set[int] = set()
        self.upload_seconds: float | None = None
        self.transport: str | None = None
        # HVDRUNNER_ARTIFACT_TRANSPORT=stream turns the same-host copy off (tests of the stream use it).
        self.same_host_copy = os.environ.get("HVDRUNNER_ARTIFACT_TRANSPORT", "auto") != "stream"
        self._emit_logs = emit_logs
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self.address: tuple[str, int] | None = None
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.errors: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.rejected = 0
        self.started: set[int] = set()
        self.started_event = threading.Event()
        self.expected_tasks = 0
        self._conns: set[wire.ServerConnection] = set()
        self._transfers: set[wire.ServerConnection] = set()
        self._proofs: Path | None = None

    def start(self, host: str) -> tuple[str, int] | None:
        try:
            self._listener = wire.listen(host)
        except OSError as err:
            log.info("Not listening for rank logs on %s (%s); logs will come back with the results", host, err)
            return None
        self.address = (host, self._listener.getsockname()[1])
        wire.serve(self._listener, self._secret, self._serve, "hvdrunner-channel")
        return self.address

    def close(self) -> None:
        """Stop listening and hang up on every client; tasks still running take that as cancel."""
        self._closed.set()
        if self._proofs is not None:
            shutil.rmtree(self._proofs, ignore_errors=True)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _serve(self, conn: wire.ServerConnection) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            while True:
                msg = conn.recv()
                if msg.get("t") in ("put", "fetch-resume"):
                    with self._lock:
                        self._transfers.add(conn)  # a file transfer: hung up on by close(), never sent a broadcast
                    if msg["t"] == "put":
                        self._receive_artifacts(conn)
                    else:
                        self._send_resume(conn)
                else:
                    self.handle(msg)
        except wire.AuthenticationError:
            with self._lock:
                self.rejected += 1
            log.warning("Refused a connection to the rank log channel that was not signed with this run's secret")
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._transfers.discard(conn)
            conn.close()

    def _receive_artifacts(self, conn: wire.ServerConnection) -> None:
        """Rank 0's artifacts into the staging folder: copied here if its folder is on this host, else streamed."""
        from airflow_provider_horovod.runner.artifacts import take_tree

        if self._artifact_staging is None:
            conn.recv()  # the offer
            conn.send({"mode": "none"})
            conn.send({"ok": False, "error": "this run collects no artifacts"})
            return
        self.upload_started.set()
        began = time.monotonic()
        try:
            _mode, self.received = take_tree(conn, self._artifact_staging, allow_copy=self.same_host_copy,
                                             cancelled=self._closed.is_set, chosen=self._chose)
            self.upload_seconds = time.monotonic() - began
        except OSError as err:  # the driver's disk: full, or the folder went away
            self.upload_error = err
            with contextlib.suppress(OSError):
                conn.send({"ok": False, "error": str(err)})
            raise ConnectionError(str(err)) from err
        self.upload_done.set()  # everything is in staging, whether or not the receipt reaches the task
        conn.send({"ok": True, "files": len(self.received)})

    def _chose(self, mode: str) -> None:
        self.transport = mode

    def _send_resume(self, conn: wire.ServerConnection) -> None:
        from airflow_provider_horovod.runner.artifacts import offer_tree

        proofs = self._proof_dir() if self.same_host_copy and self._resume_root is not None else None
        offer_tree(conn, self._resume_root, proofs)

    def _proof_dir(self) -> Path:
        """A private folder on the driver for the proof files of its own offers."""
        with self._lock:
            if self._proofs is None:
                self._proofs = Path(tempfile.mkdtemp(prefix="hvdrunner-offers-"))
            return self._proofs

    def broadcast(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to every connected client (``{"t": "stop"}``: end your ranks now)."""
        with self._lock:
            conns = list(self._conns - self._transfers)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(msg)

    def handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "logs":
            self.lines(int(msg["rank"]), msg["lines"], callback=bool(msg.get("callback")))
        elif kind == "event":
            with self._lock:
                self.events.append(msg)
            if msg.get("kind") == "task-started":
                with self._lock:
                    self.started.add(int(msg["partition"]))
                    if self.expected_tasks and len(self.started) >= self.expected_tasks:
                        self.started_event.set()
        elif kind == "error":
            self.error(msg)
        if kind == "event" and msg.get("kind") == "task-done":
            with self._lock:
                self.done.add(int(msg["partition"]))

    def lines(self, rank: int, lines: list[str], *, callback: bool = False) -> None:
        with self._lock:
            self.tails[rank].extend(lines)
        if self._emit_logs or callback:
            for line in lines:
                rank_log.info("[rank %d] %s", rank, line)

    def error(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self.errors.append(msg)


class ChannelClient:
    """A non-blocking sender: ``send`` queues, a daemon thread writes. Never raises to its caller."""

    def __init__(
        self,
        address: tuple[str, int] | None,
        secret: bytes,
        *,
        connect_timeout: float = 3.0,
        on_lost: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        """``on_lost`` is called (from a daemon thread) if the driver hangs up before ``close()``:
        the driver was cancelled or died, and whatever this client's process runs must stop."""
        self._closing = False
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10000)
        self._conn: wire.ClientConnection | None = None
        self._thread: threading.Thread | None = None
        if address is None:
            return
        try:
            self._conn = wire.connect(address, secret, timeout=connect_timeout)
        except OSError:
            self._conn = None
            return
        self._thread = threading.Thread(target=self._loop, name="hvdrunner-channel-client", daemon=True)
        self._thread.start()
        if on_lost is not None or on_stop is not None:
            threading.Thread(target=self._watch, args=(self._conn, on_lost, on_stop), daemon=True).start()

    def _watch(self, conn: wire.ClientConnection, on_lost, on_stop) -> None:
        """The driver sends only ``stop``; a hang-up before ``close()`` means cancel (or a dead driver)."""
        with contextlib.suppress(Exception):
            while True:
                if conn.recv().get("t") == "stop" and on_stop is not None:
                    on_stop()
        if not self._closing and on_lost is not None:
            on_lost()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, msg: dict[str, Any]) -> None:
        if self._conn is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(msg)

    def send_now(self, msg: dict[str, Any], timeout: float = 5.0) -> None:
        """Queue ``msg`` and wait (bounded) until everything queued so far is written."""
        if self._conn is None:
            return
        self.send(msg)
        self.flush(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self._conn is not None and self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _loop(self) -> None:
        assert self._conn is not None
        while True:
            msg = self._queue.get()
            try:
                if msg is None:
                    return
                self._conn.send(msg)
            except OSError:
                self._conn = None
                return
            finally:
                self._queue.task_done()

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self._conn is None:
            return
        self.flush(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        if self._thread is not None:
            self._thread.join(timeout)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
