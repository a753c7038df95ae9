"""What the cluster says about barrier slots a restart is missing: whether they can come at all.

A restart that has ``min_np`` slots waits a last call for the rest (``restarts.RestartPolicy``)
only where more can come. They cannot on a local master (``local[N]``: the tasks run in the
driver's JVM, no executor ever joins), nor on a standalone cluster whose alive workers have too few
cores for ``np`` tasks (a worker gone for good: no executor of the others brings its slots, until
someone starts a worker). The standalone master is asked as its own web UI and ``spark-class
org.apache.spark.deploy.Client`` ask it: ``RequestMasterState`` over Spark's RPC, with the
application's own RPC environment (and so its authentication). Other cluster managers (YARN,
Kubernetes) can add executors: they get the last call.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

log = logging.getLogger(__name__)
ASK_TIMEOUT_S = 5  # a master that does not answer within this long says nothing (the restart waits its last call)


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


def can_reach(spark: Any, np: int) -> bool:
    """Whether ``np`` barrier slots can still come to this session's application, as the cluster
    says (``True`` where it cannot say: Spark Connect, YARN, Kubernetes, an unreachable master)."""
    master = master_of(spark)
    if fixed_slots(master):
        return False
    if master and master.startswith("spark://") and "," not in master:
        cores = standalone_alive_cores(spark, master)
        if cores is not None:
            return cores // _task_cpus(spark) >= np
    return True


def standalone_alive_cores(spark: Any, master: str) -> int | None:
    """The cores of the standalone ``master``'s alive workers (``None`` when it cannot be asked)."""
    with contextlib.suppress(Exception):
        sc = spark.sparkContext
        jvm = sc._jvm
        rpc_env = sc._jsc.sc().env().rpcEnv()
        address = _scala_object(jvm, "org.apache.spark.rpc.RpcAddress$").fromSparkURL(master)
        ref = rpc_env.setupEndpointRef(address, "Master")
        request = _scala_object(jvm, "org.apache.spark.deploy.DeployMessages$RequestMasterState$")
        response_class = jvm.java.lang.Class.forName("org.apache.spark.deploy.DeployMessages$MasterStateResponse")
        tag = _scala_object(jvm, "scala.reflect.ClassTag$").apply(response_class)
        seconds = jvm.scala.concurrent.duration.FiniteDuration(ASK_TIMEOUT_S, jvm.java.util.concurrent.TimeUnit.SECONDS)
        timeout = jvm.org.apache.spark.rpc.RpcTimeout(seconds, "spark.rpc.askTimeout")
        workers = ref.askSync(request, timeout, tag).workers()
        return sum(worker.cores() for worker in workers if worker.isAlive())
    log.debug("Could not ask the standalone master %s for its workers", master)
    return None


def _scala_object(jvm: Any, name: str) -> Any:
    """A Scala ``object``'s instance (``MODULE$``) through py4j."""
    cls = jvm.java.lang.Class.forName(name)
    return cls.getField("MODULE$").get(None)


def _task_cpus(spark: Any) -> int:
    with contextlib.suppress(Exception):
        return max(1, int(spark.conf.get("spark.task.cpus", "1")))
    return 1
