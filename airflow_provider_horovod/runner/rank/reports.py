"""Rank 0's side of ``runtime.report``: reports coalesced on their way to the driver.

Training may report every step; the channel carries at most one report per ``SEND_INTERVAL_S``,
the newest (and the last one, when the rank ends). The rank holds one report at any time, and a
report costs the training loop a lock and an assignment.
"""

from __future__ import annotations

import threading

from airflow_provider_horovod.runner.messages import Report

SEND_INTERVAL_S = 0.5  # the most often a report travels; what the driver keeps (metrics.jsonl, MLflow)


class Reporter:
    """The newest report waits here; a daemon thread, started by the first report, sends it."""

    def __init__(self, client, interval: float = SEND_INTERVAL_S) -> None:
        self._client = client
        self._interval = interval
        self._pending: Report | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, report: Report) -> None:
        if self._closing.is_set():
            return
        with self._lock:
            self._pending = report
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hvdrunner-reports", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while not self._closing.wait(self._interval):
            self._send()

    def _send(self) -> None:
        with self._lock:
            report, self._pending = self._pending, None
        if report is not None:
            self._client.send(report)

    def close(self) -> None:
        """Send the last report now (the rank is ending); later reports are dropped."""
        self._closing.set()
        thread = self._thread
        if thread is not None:
            thread.join(self._interval + 1.0)
        self._send()
