"""Every scenario of ``test_cluster.py``'s standalone cluster, in order, in one process with one
SparkSession (an application's start is paid once): np=2 jobs on the two executors, then the restart
runs (``restart_runs.py``; the last loses a worker for good), then the late executor
(``late_executor.py``) on the one worker left, whose second worker the test starts late.

usage: python -m tests.integration.scenarios.cluster_runs MASTER CONF_JSON OUT_DIR LAUNCHER[/host]...

Writes ``runs.json`` (the np=2 jobs), ``restarts.json`` and ``late.json`` into OUT_DIR; each scenario's
seconds are printed as it ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

DATASET_ROWS = 101  # odd: the two shards differ by one row


def run_jobs(spark, out: Path) -> dict:
    """np=2 jobs on the two executors: each launcher's layout and dataset= (one run each), DDP and
    accelerate, artifacts by stream."""
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import dataset_jobs, jobs, torch_jobs

    jobs.by_value(dataset_jobs)
    results = {}
    for launcher in ("mpirun", "gloo"):  # the layout; dataset=: each executor's task spills the shard its rank reads
        runner = HorovodRunner(2, launcher=launcher, spark=spark, dataset=spark.range(DATASET_ROWS, numPartitions=3))
        result = runner.run(jobs.layout_then_job, tag=launcher, then=dataset_jobs.shard_job, batch_size=8)
        results[launcher] = {"result": result["layout"], "events": runner.last_run.events}
        results["dataset-" + launcher] = {"result": result["then"], "events": runner.last_run.events}
    # launcher="torch": unmodified DDP code on two executors (two hosts, one simulated GPU each)
    runner = HorovodRunner(2, launcher="torch", spark=spark, dataset=spark.range(DATASET_ROWS, numPartitions=3))
    results["torch"] = {"result": runner.run(torch_jobs.ddp_job, steps=2, use_dataset=True),
                        "plan": next(e["slots"] for e in runner.last_run.events if e.get("kind") == "plan")}
    results["accelerate"] = HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.accelerate_job, steps=1)
    # The executors stand for two hosts: rank 0's files come over the channel, as from another
    # machine, instead of being copied from a folder the driver happens to share here.
    os.environ["HVDRUNNER_ARTIFACT_TRANSPORT"] = "stream"
    try:
        runner = HorovodRunner(2, launcher="mpirun", spark=spark, artifact_dir=out / "artifacts", timeline=True)
        result = runner.run(jobs.checkpoint_job, epochs=2)
    finally:
        del os.environ["HVDRUNNER_ARTIFACT_TRANSPORT"]
    results["artifacts"] = {"result": result, "driver_pid": os.getpid(),
                            "last_run": {k: v for k, v in dataclasses.asdict(runner.last_run).items() if k != "result"}}
    return results


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    master, conf, out, restarts = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    from tests.integration.cluster import app_session
    from tests.integration.scenarios import late_executor, restart_runs

    began = time.monotonic()
    spark = app_session(master, conf, "hvdrunner-cluster-tests")
    print("cluster session ready: %.1f s" % (time.monotonic() - began), flush=True)
    try:
        for name, scenario in [("runs", lambda: run_jobs(spark, out)),
                               ("restarts", lambda: restart_runs.run_restarts(spark, out, restarts)),
                               ("late", lambda: late_executor.run_late(spark, out))]:
            began = time.monotonic()
            (out / ("%s.json" % name)).write_text(json.dumps(scenario()))
            print("cluster scenario %s: %.1f s" % (name, time.monotonic() - began), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
