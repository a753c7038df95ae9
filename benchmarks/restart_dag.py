"""The DAGs of ``benchmarks/restart.py`` (copied into its throwaway DAGs folder; not an example).

Two tasks train the same function on np=3 barrier tasks of a standalone cluster; in each, rank 1's
executor JVM is SIGKILLed after step 3 of the first attempt. ``in_try`` recovers inside the try
(``max_restarts=1``, ``retries=0``); ``by_retry`` through an Airflow retry (``max_restarts=0``,
``retries=1``, ``retry_delay`` 0 and the provider's retry policy with ``lost_delay`` 0). Two DAGs run them in either order (the benchmark alternates).
"""

from __future__ import annotations

import datetime
import os

import pendulum

from airflow.sdk import dag, task
from airflow_provider_horovod.retry import HorovodRetryPolicy

BENCH_DIR = os.environ.get("HVD_RESTART_BENCH_DIR", "/nonexistent")
NP = 3
CONN_ID = "spark_restart_bench"  # the benchmark's standalone cluster


def train(bench_dir: str, key: str, steps: int = 12, pause: float = 0.3):
    """Rank 0 commits ``step.txt`` every step and resumes after the step in ``resume_dir()``. In an
    attempt that resumed nothing, rank 1 writes its executor JVM's pid to ``<key>.pid`` after step 3
    for the benchmark to SIGKILL, then waits for the loss. In an attempt that resumed, rank 0 writes
    the wall clock at the end of its first training step (an allreduce every rank joined) to
    ``<key>.first-step``; at the end, its result to ``<key>.result``."""
    import json
    import time
    from pathlib import Path

    import horovod.torch as hvd
    import psutil
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    resume = runtime.resume_dir()
    start = int((resume / "step.txt").read_text()) + 1 if resume is not None else 0
    out = Path(bench_dir)
    for step in range(start, steps):
        hvd.allreduce(torch.ones(1), name="step")
        if resume is not None and step == start and hvd.rank() == 0:
            (out / (key + ".first-step.tmp")).write_text(repr(time.time()))
            os.replace(out / (key + ".first-step.tmp"), out / (key + ".first-step"))
        if hvd.rank() == 0:
            (runtime.checkpoint_dir() / "step.txt").write_text(str(step))
            runtime.commit_checkpoint(step=step)
        if resume is None and step >= 3:
            time.sleep(0.5)  # this step's version reaches the driver first
            if hvd.rank() == 1:
                java = next(p for p in psutil.Process().parents() if p.name() == "java")
                (out / (key + ".pid.tmp")).write_text(str(java.pid))
                os.replace(out / (key + ".pid.tmp"), out / (key + ".pid"))
            time.sleep(600)  # the loss ends this attempt
        time.sleep(pause)
    result = {"start": start, "attempt": runtime.attempt(), "size": hvd.size()}
    if hvd.rank() == 0:
        (out / (key + ".result")).write_text(json.dumps(result))
    return result


def _tasks() -> dict:
    @task.horovod(np=NP, spark_conn_id=CONN_ID, max_restarts=1, retries=0)
    def in_try():
        return train(BENCH_DIR, "in_try")

    # the provider's retry policy waits lost_delay (30 s) after a loss, whatever retry_delay says: 0 here
    @task.horovod(np=NP, spark_conn_id=CONN_ID, max_restarts=0, retries=1, retry_delay=datetime.timedelta(seconds=0),
                  retry_policy=HorovodRetryPolicy(lost_delay=0))
    def by_retry():
        return train(BENCH_DIR, "by_retry")

    return {"in_try": in_try, "by_retry": by_retry}


def _bench_dag(order: tuple[str, str]):
    @dag(dag_id="hvd_restart_bench_" + "_then_".join(order), schedule=None,
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False)
    def bench():
        tasks = _tasks()
        tasks[order[0]]() >> tasks[order[1]]()

    return bench()


_bench_dag(("in_try", "by_retry"))
_bench_dag(("by_retry", "in_try"))
