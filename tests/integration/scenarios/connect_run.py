"""Runs an np=2 Gloo job, a dataset= job under each Horovod launcher and a DDP job under the torch
launcher, through a real Spark Connect session (a local Connect server).

usage: python -m tests.integration.scenarios.connect_run OUT_JSON
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner
    from tests.integration import dataset_jobs, jobs, torch_jobs
    from tests.integration.scenarios.cluster_runs import DATASET_ROWS

    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    try:
        assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
        runner = HorovodRunner(2, launcher="gloo", spark=spark)
        result = runner.run(jobs.allreduce_job, tag="connect")
        out = {"result": result, "session": type(spark).__module__}
        for launcher in ("mpirun", "gloo"):
            dataset = spark.range(DATASET_ROWS, numPartitions=3)  # a Connect DataFrame
            runner = HorovodRunner(2, launcher=launcher, spark=spark, dataset=dataset)
            out["dataset-" + launcher] = {"result": runner.run(dataset_jobs.shard_job, batch_size=8),
                                          "dataframe": type(dataset).__module__}
        dataset = spark.range(DATASET_ROWS, numPartitions=3)
        out["torch"] = HorovodRunner(2, launcher="torch", spark=spark, dataset=dataset).run(
            torch_jobs.ddp_job, steps=2, use_dataset=True)
        out["accelerate"] = HorovodRunner(2, launcher="torch", spark=spark).run(torch_jobs.accelerate_job, steps=1)
    finally:
        spark.stop()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
