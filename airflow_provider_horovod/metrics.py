"""What the driver does with rank 0's reports (``runtime.report``): the try's ``metrics.jsonl``,
committed to the store every few seconds (the rows since the last commit, one new object each
time; the whole file only after it was thinned), a progress line in the task log at most every
``progress_interval`` seconds, and whatever else listens (MLflow). Memory stays flat: the file is
on disk, and only the first and the newest report are held; the file stays within ``MAX_BYTES``."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.options import DEFAULT_PROGRESS_INTERVAL_S
from airflow_provider_horovod.runner.records import MetricsRow

COMMIT_INTERVAL_S = 5.0  # how often metrics.jsonl is committed to the store while the try runs
# The try's metrics history on the driver's disk (and in the store): rank 0's reports reach the
# recorder at most twice a second (the channel's ReportGate); a row of a few metrics is ~200 bytes
# (at most ~8 KiB: 64 metrics), so ~12 hours of reports fit; beyond that the rows are thinned
# evenly, never cut off at the end.
MAX_BYTES = 16 << 20
MAX_DURATION_S = 10000 * 3600  # longer is shown as "over 10000h"


def check_progress_interval(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError("progress_interval must be a positive number of seconds; got %r" % (value,))
    return float(value)


def duration_text(seconds: float) -> str:
    """``48s``, ``1m48s``, ``2h03m``; total: ``-`` for what is no duration (negative, infinite, NaN)
    and ``over 10000h`` for what no training lasts."""
    if not 0 <= seconds < float("inf"):
        return "-"
    if seconds >= MAX_DURATION_S:
        return "over %dh" % (MAX_DURATION_S // 3600)
    seconds = int(round(seconds))
    if seconds < 60:
        return "%ds" % seconds
    if seconds < 3600:
        return "%dm%02ds" % divmod(seconds, 60)
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


def rate(first: Report, newest: Report) -> float | None:
    """Steps per second between two reports; ``None`` without two steps some time apart."""
    if first.step is None or newest.step is None or newest.time <= first.time or newest.step <= first.step:
        return None
    speed = (newest.step - first.step) / (newest.time - first.time)
    return speed if math.isfinite(speed) else None  # steps over a subnormal time apart: no rate


def progress_line(first: Report, newest: Report) -> str:
    """``Horovod progress: step 1200/5000 (24%), loss 0.41, acc 0.88, 35.2 steps/s, ETA 1m48s``."""
    parts = []
    if newest.step is not None:
        step = "step %d" % newest.step
        if newest.total_steps:
            step += "/%d (%d%%)" % (newest.total_steps, 100 * newest.step // newest.total_steps)
        parts.append(step)
    parts += ["%s %.4g" % (name, value) for name, value in newest.metrics.items()]
    speed = rate(first, newest)
    if speed is not None:
        parts.append("%.1f steps/s" % speed)
        if newest.total_steps and newest.step is not None and newest.step < newest.total_steps:
            parts.append("ETA %s" % duration_text((newest.total_steps - newest.step) / speed))
    return "Horovod progress: %s" % (", ".join(parts) or "reported")


def final_values(newest: Report | None) -> dict[str, Any]:
    """The try's final metrics as the XCom, the return value and the asset event carry them."""
    if newest is None:
        return {}
    out: dict[str, Any] = dict(newest.metrics)
    if newest.step is not None:
        out["step"] = newest.step
    if newest.total_steps is not None:
        out["total_steps"] = newest.total_steps
    return out


class MetricsRecorder:
    """Takes rank 0's reports (the engine's ``on_report``): appends each to a local
    ``metrics.jsonl``, commits what is new with ``commit(data, base=False)`` every
    ``COMMIT_INTERVAL_S`` (``base=True``: the whole file, after it was thinned), logs a
    progress line at most every ``progress_interval`` seconds and passes each report to ``listeners``
    (each handles its own errors)."""

    def __init__(self, local: Path, *, commit: Callable[..., None], log: logging.Logger,
                 progress_interval: float = DEFAULT_PROGRESS_INTERVAL_S,
                 listeners: tuple[Callable[[Report], None], ...] = (), clock: Callable[[], float] = time.monotonic):
        self.local = local
        self._commit = commit
        self._log = log
        self._interval = check_progress_interval(progress_interval)
        self._listeners = listeners
        self._clock = clock
        self._lock = threading.Lock()
        self.first: Report | None = None
        self.newest: Report | None = None
        self._logged: Report | None = None
        self._last_line = self._last_commit = float("-inf")
        self._committed_size = 0
        self._rewritten = False  # thinned since the last commit: the next one is a base
        self._size = 0  # of the local file
        self._stride, self._seen = 1, 0  # every stride-th report is kept: 1 until the file reaches MAX_BYTES
        self._written: Report | None = None

    def __call__(self, report: Report) -> None:
        with self._lock:
            self.first = self.first or report
            self.newest = report
            self._seen += 1
            if (self._seen - 1) % self._stride == 0:
                self._write(report)
            now = self._clock()
            if now - self._last_line >= self._interval:
                self._last_line = now
                self._progress()
            if now - self._last_commit >= COMMIT_INTERVAL_S:
                self._last_commit = now
                self._store()
        for listener in self._listeners:
            listener(report)

    def _write(self, report: Report) -> None:
        line = MetricsRow.of(report).to_line() + "\n"
        with self.local.open("a") as out:
            out.write(line)
        self._written, self._size = report, self._size + len(line.encode())
        if self._size > MAX_BYTES:
            self._thin()

    def _thin(self) -> None:
        """Keep every other row and from now on every other report: the history stays within
        ``MAX_BYTES``, spread evenly over the whole try (``close`` writes the newest report)."""
        kept = self.local.read_bytes().splitlines(keepends=True)[::2]
        tmp = self.local.with_name(self.local.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        tmp.replace(self.local)
        self._size, self._stride = sum(len(line) for line in kept), self._stride * 2
        self._rewritten = True
        self._log.info("metrics.jsonl reached %d bytes: every other row kept, from now on one report in %d",
                       MAX_BYTES, self._stride)

    def close(self) -> dict[str, Any]:
        """The try ended: the newest report written, the last progress line and commit, if they
        missed it; the final values."""
        with self._lock:
            if self.newest is not None and self._written is not self.newest:
                self._write(self.newest)
            if self.newest is not None and self._logged is not self.newest:
                self._progress()
            if self.local.exists() and (self._rewritten or self.local.stat().st_size != self._committed_size):
                self._store()
            return final_values(self.newest)

    def _progress(self) -> None:
        self._logged = self.newest
        try:
            self._log.info("%s", progress_line(self.first, self.newest))
        except (ArithmeticError, ValueError) as err:  # nothing a rank reported may stop the try's store
            self._log.warning("No progress line for step %s: %s", self.newest.step, err)

    def _store(self) -> None:
        """Commit the rows written since the last commit (all of them after a thinning); one that
        fails is sent again with the next."""
        try:
            with self.local.open("rb") as f:
                if not self._rewritten:
                    f.seek(self._committed_size)
                data = f.read()
            if not data and not self._rewritten:
                return
            self._commit(data, base=self._rewritten)
            self._committed_size = len(data) + (0 if self._rewritten else self._committed_size)
            self._rewritten = False
        except Exception as err:  # noqa: BLE001 - the next commit tries again; training goes on
            self._log.warning("Could not commit the try's metrics to the artifact store (the next commit sends them again): %s", err)
