"""Runs np=2 jobs on a standalone cluster (its own SparkSession, in its own process).

usage: python -m tests.integration.scenarios.cluster_runs MASTER CONF_JSON OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

DATASET_ROWS = 101  # odd: the two shards differ by one row


def main() -> None:
    master, conf, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import dataset_jobs, jobs, torch_jobs
    from tests.integration.cluster import app_session

    spark = app_session(master, conf, "hvdrunner-cluster-tests")
    results = {}
    try:
        for launcher in ("mpirun", "gloo"):
            runner = HorovodRunner(2, launcher=launcher, spark=spark)
            result = runner.run(jobs.allreduce_job, tag=launcher)
            results[launcher] = {"result": result, "events": runner.last_run.events}
        for launcher in ("mpirun", "gloo"):  # dataset=: each executor's task spills the shard its rank reads
            runner = HorovodRunner(2, launcher=launcher, spark=spark, dataset=spark.range(DATASET_ROWS, numPartitions=3))
            result = runner.run(dataset_jobs.shard_job, batch_size=8)
            results["dataset-" + launcher] = {"result": result, "events": runner.last_run.events}
        # launcher="torch": unmodified DDP code on two executors (two hosts, one simulated GPU each)
        runner = HorovodRunner(2, launcher="torch", spark=spark, dataset=spark.range(DATASET_ROWS, numPartitions=3))
        results["torch"] = {"result": runner.run(torch_jobs.ddp_job, steps=2, use_dataset=True),
                            "plan": next(e["slots"] for e in runner.last_run.events if e.get("kind") == "plan")}
        results["accelerate"] = HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.accelerate_job, steps=1)
        artifact_dir = os.path.join(os.path.dirname(out), "artifacts")
        # The executors stand for two hosts: rank 0's files come over the channel, as from another
        # machine, instead of being copied from a folder the driver happens to share here.
        os.environ["HVDRUNNER_ARTIFACT_TRANSPORT"] = "stream"
        runner = HorovodRunner(2, launcher="mpirun", spark=spark, artifact_dir=artifact_dir, timeline=True)
        result = runner.run(jobs.checkpoint_job, epochs=2)
        results["artifacts"] = {"result": result, "last_run": {k: v for k, v in dataclasses.asdict(runner.last_run).items() if k != "result"},
                                "driver_pid": os.getpid()}
    finally:
        spark.stop()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
