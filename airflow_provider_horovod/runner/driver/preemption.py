"""The preemption notice on the driver side: Spark decommissions an executor of the attempt.

While an attempt runs, a thread asks the SparkContext's scheduler every ``POLL_S`` which of the
application's executors are being decommissioned (``TaskSchedulerImpl.getExecutorDecommissionState``:
a worker or node drained, a spot instance reclaimed, with ``spark.decommission.enabled``). The first
time one is, ``on_notice`` runs once (the attempt tells every barrier task, whose ranks see
``runtime.preempting()``). Spark Connect sessions have no SparkContext to ask: no notice there.

Every executor of the application counts, not only those running the attempt's tasks: the barrier
stage holds the application's slots in the usual setup (one Spark application per try), and a
needless notice costs one early checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
POLL_S = 0.5


def decommissioning(spark: Any) -> list[str] | None:
    """The ids of the application's executors being decommissioned now; ``None`` when this session
    cannot say (Spark Connect, or a scheduler without decommission)."""
    with contextlib.suppress(Exception):
        sc = spark.sparkContext._jsc.sc()
        scheduler, backend = sc.taskScheduler(), sc.schedulerBackend()
        seq = backend.getExecutorIds()  # a Scala Seq: py4j does not iterate it
        ids = [seq.apply(i) for i in range(seq.length())]
        return [i for i in ids if scheduler.getExecutorDecommissionState(i).isDefined()]
    return None


class DecommissionWatch:
    """Polls ``decommissioning(spark)`` from a daemon thread until ``stop()``; ``on_notice(ids)`` once."""

    def __init__(self, spark: Any, on_notice: Callable[[list[str]], None]) -> None:
        self._spark = spark
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdrunner-decommission", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        # an executor already decommissioning runs no task of this attempt (Spark schedules none there):
        # the executor a restart follows may still be listed, and is no notice for the new attempt
        before = set(decommissioning(self._spark) or ())
        while not self._stop.wait(POLL_S):
            found = decommissioning(self._spark)
            if found is None:
                return  # nothing to ask: no notice, no more polling
            new = [i for i in found if i not in before]
            if new:
                self._on_notice(new)
                return

    def stop(self) -> None:
        self._stop.set()
