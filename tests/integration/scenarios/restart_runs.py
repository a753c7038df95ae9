"""The executor JVM hosting rank 1 is SIGKILLed mid-training on a standalone cluster, then, in the
next attempt, the one hosting rank 0; the same ``run()`` restarts from the newest committed version
each time (``run_restarts``, on ``cluster_runs.py``'s SparkSession).

``LAUNCHER/host``: the worker that started that executor is decommissioned (SIGPWR; the cluster
has ``spark.decommission.enabled``), and it and the executor are killed once rank 0 has committed
the version the notice asks for (and ``SETTLE_S`` more, in which no rank may step on) or ``NOTICE_S``
after the notice, whichever comes first (a host gone for good, with a preemption notice); the run has
``min_np=1``, the default ``last_call`` (30 s), ``start_timeout=HOST_START_TIMEOUT_S`` and a
``dataset=`` of ``DATASET_ROWS`` rows, trains ``jobs.preemptible_job`` and restarts on the one slot
left at once: Spark decommissioned that worker (``capacity.can_grow``). ``LAUNCHER``: ``max_restarts=2`` and no ``artifact_dir`` (the engine
keeps the versions in a run folder of its own); attempt 0 loses rank 1's executor, attempt 1 rank 0's
(partition 0: mpirun, Horovod's rendezvous or torch's store), attempt 2 finishes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

DATASET_ROWS = 101
NOTICE_S = 10.0  # the most a decommissioned host lives on
SETTLE_S = 2.0  # how long it lives on after rank 0's version: ranks step every 0.3 s, none may commit again
VICTIMS = [1, 0]  # LAUNCHER: the rank whose executor is killed, in attempts 0 and 1
HOST_START_TIMEOUT_S = 60.0  # LAUNCHER/host: longer than the last call, so a restart that waited either shows


def kill_when_told(marker: Path, committed: list[int], done: threading.Event, host: bool) -> list[dict]:
    """Start a thread that SIGKILLs the pid a rank writes to ``marker`` (its executor's JVM; with
    ``host``, the standalone worker that started it is decommissioned first, then killed too, once
    a version is committed after the notice and ``SETTLE_S`` passed, ``NOTICE_S`` after it at most),
    each time it does; returns the kills (pid, the newest step committed before, the notice's seconds)."""
    import psutil

    kills: list[dict] = []

    def watch() -> None:
        while not done.wait(0.1):
            if marker.exists():
                pid = int(marker.read_text())
                marker.unlink()
                worker = psutil.Process(pid).ppid()
                noticed = time.monotonic()
                if host:
                    os.kill(worker, signal.SIGPWR)
                    wait_for_version(committed, noticed + NOTICE_S)
                kills.append({"pid": pid, "newest_step": max((s for s in committed if s is not None), default=None),
                              "committed": list(committed), "notice_s": round(time.monotonic() - noticed, 2),
                              "at": time.monotonic()})
                if host:
                    os.kill(worker, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    return kills


def wait_for_version(committed: list[int], deadline: float) -> None:
    """Until a version with a step is committed and ``SETTLE_S`` more passed, or ``deadline``."""
    while not any(s is not None for s in committed) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(max(0.0, min(SETTLE_S, deadline - time.monotonic())))


def run_restarts(spark, out: Path, launchers: list[str]) -> dict:
    """The restart runs named by ``launchers`` (``LAUNCHER`` or ``LAUNCHER/host``), in order: what each showed."""
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import jobs

    results = {}
    for name in launchers:
        launcher, host = name.split("/")[0], name.endswith("/host")
        folder = name.replace("/", "-")
        committed: list[int] = []
        done = threading.Event()
        marker = out / ("jvm-%s" % folder)
        kills = kill_when_told(marker, committed, done, host)
        runner = HorovodRunner(2, launcher=launcher, spark=spark, artifact_dir=out / folder if host else None,
                               max_restarts=1 if host else len(VICTIMS), min_np=1 if host else None,
                               start_timeout=HOST_START_TIMEOUT_S if host else 60,
                               dataset=spark.range(DATASET_ROWS) if host else None,
                               on_checkpoint=lambda version, _path: committed.append(version.step))
        began = time.monotonic()
        try:
            if host:
                result = runner.run(jobs.preemptible_job, marker=str(marker), with_dataset=True)
            else:
                result = runner.run(jobs.restartable_job, loss="jvm", marker=str(marker), victim=VICTIMS,
                                    losses=len(VICTIMS),
                                    collective="torch" if launcher == "torch" else "horovod")
        finally:
            done.set()
        last_started = runner._last.ranks_started_at  # the last attempt's ranks (monotonic, this process)
        results[name] = {"result": result, "kills": kills, "attempts": runner.last_run.attempts_json(),
                         "notices": [e for e in runner.last_run.events if e.get("kind") == "preempting"],
                         "seconds": time.monotonic() - began, "artifact_dir": runner.last_run.artifact_dir,
                         "checkpoints": runner.last_run.checkpoints,
                         "last_started_after_kill_s": last_started - kills[-1]["at"] if kills and last_started else None,
                         "workers_gone": runner._last.workers_gone}  # what the last restart was told
    return results
