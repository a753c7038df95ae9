"""What the cluster says about barrier slots: how many there are now, and whether those a restart
is missing can come at all.

A restart that has ``min_np`` slots waits a last call for the rest (``restarts.RestartPolicy``)
only where more can come. They cannot on a local master (``local[N]``: the tasks run in the
driver's JVM, no executor ever joins), nor on a standalone cluster once Spark decommissioned the
worker of an executor of the attempt before (``ExecutorDecommissionState.workerHost``, read at the
notice: the scheduler forgets it when the executor is gone; the master starts no executor on a
decommissioned worker, and the other workers' free slots are already counted). Elsewhere (YARN,
Kubernetes, a worker that died without notice) more can come: the restart gives them its last call.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any


def fixed_slots(master: str | None) -> bool:
    """Whether a master's barrier slots can never grow: a local master (``local``, ``local[N]``,
    ``local[*]``, ``local[N,F]``) runs its tasks in the driver's JVM, where no executor joins."""
    return bool(master) and re.fullmatch(r"local(\[[^\]]*\])?", str(master).strip()) is not None


def master_of(spark: Any) -> str | None:
    with contextlib.suppress(Exception):
        return spark.sparkContext.master
    with contextlib.suppress(Exception):
        return spark.conf.get("spark.master", None)
    return None


def available_slots(spark: Any) -> int | None:
    """How many barrier tasks the cluster can run at once (classic sessions only)."""
    with contextlib.suppress(Exception):
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    return None


def can_grow(spark: Any, workers_gone: list[str]) -> bool:
    """Whether more barrier slots can still come to this session's application, as the cluster says
    (``workers_gone``: executors of the attempt before whose worker Spark decommissioned)."""
    master = master_of(spark)
    if fixed_slots(master):
        return False
    return not (master and master.startswith("spark://") and workers_gone)


def worker_decommissioned(spark: Any, executor: str) -> bool:
    """Whether Spark is decommissioning ``executor`` with its whole worker (ask while the executor is
    still there: the scheduler forgets the state once it is removed); ``False`` when it cannot say."""
    with contextlib.suppress(Exception):
        state = spark.sparkContext._jsc.sc().taskScheduler().getExecutorDecommissionState(executor)
        return bool(state.isDefined() and state.get().workerHost().isDefined())
    return False
