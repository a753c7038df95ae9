"""A barrier task's or a rank process's connection to the driver's channel (``driver/channel.py``):
authenticated frames out through a daemon thread, the driver's orders (plan, start, release, stop) in.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from airflow_provider_horovod.runner import messages, network, wire


class ChannelClient:
    """A task's or a rank's connection to the driver. ``send`` queues and a daemon thread writes
    (it never raises); ``wait_for`` reads the driver's orders (plan, start, release)."""

    def __init__(
        self,
        address: tuple[str, int] | None,
        credentials: wire.Credentials,
        *,
        connect_timeout: float = 3.0,
        on_lost: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        on_preempting: Callable[[], None] | None = None,
    ) -> None:
        """``on_lost`` is called (from a daemon thread) if the driver hangs up before ``close()``:
        the driver was cancelled or died, and whatever this client's process runs must stop.
        ``on_stop`` is called when the driver sends ``stop``, ``on_preempting`` when it sends ``preempting``."""
        self._closing = False
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10000)
        self._inbox: queue.Queue[messages.Message | None] = queue.Queue()
        self._conn: wire.ClientConnection | None = None
        self._thread: threading.Thread | None = None
        self.stopped = threading.Event()
        self.connect_error: str | None = None  # why the driver could not be reached, when it could not
        if address is None:
            return
        try:
            self._conn = wire.connect(address, credentials, timeout=connect_timeout)
        except OSError as err:
            self._conn = None
            self.connect_error = str(err) or type(err).__name__
            return
        self._thread = threading.Thread(target=self._loop, name="hvdrunner-channel-client", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, args=(self._conn, on_lost, on_stop, on_preempting), daemon=True).start()

    def _watch(self, conn: wire.ClientConnection, on_lost, on_stop, on_preempting=None) -> None:
        """Orders from the driver go to the inbox; a hang-up before ``close()`` means cancel (or a dead driver)."""
        with contextlib.suppress(Exception):
            while True:
                msg = messages.decode(conn.recv())
                if isinstance(msg, messages.Stop):
                    self.stopped.set()
                    if on_stop is not None:
                        on_stop()
                if isinstance(msg, messages.Preempting) and on_preempting is not None:
                    on_preempting()
                self._inbox.put(msg)
        self._inbox.put(None)
        if not self._closing and on_lost is not None:
            on_lost()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def source_address(self) -> str | None:
        """The local address this connection to the driver leaves from (None when not connected):
        the address this host is reached at (``network.task_endpoint``)."""
        return network.source_address(self._conn.sock) if self._conn is not None else None

    def wait_for(self, *kinds: type[messages.Message], timeout: float | None = None) -> messages.Message:
        """The next order of one of ``kinds`` (or ``Stop``); ``ConnectionError`` if the driver hung up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = self._inbox.get(timeout=left)
            except queue.Empty:
                raise TimeoutError("no %s from the driver within %ss" % ("/".join(k.TYPE for k in kinds), timeout)) from None
            if msg is None:
                self._inbox.put(None)
                raise ConnectionError("the driver hung up")
            if isinstance(msg, (*kinds, messages.Stop)):
                return msg

    def send(self, msg: messages.Message) -> None:
        if self._conn is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(msg.to_json())

    def send_now(self, msg: messages.Message, timeout: float = 5.0) -> None:
        """Queue ``msg`` and wait (bounded) until everything queued so far is written."""
        if self._conn is None:
            return
        self.send(msg)
        self.flush(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self._conn is not None and self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

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
