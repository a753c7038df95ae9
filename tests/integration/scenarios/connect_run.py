"""Runs a dataset= job under each Horovod launcher (under Gloo in one run with a job that returns rank
0's value), a DDP job and an accelerate function under the torch launcher, through a real Spark
Connect session (a local Connect server).

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

    jobs.by_value(dataset_jobs)
    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    try:
        assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
        out = {"session": type(spark).__module__}
        for launcher in ("mpirun", "gloo"):
            dataset = spark.range(DATASET_ROWS, numPartitions=3)  # a Connect DataFrame
            runner = HorovodRunner(2, launcher=launcher, spark=spark, dataset=dataset)
            if launcher == "gloo":  # the same run returns rank 0's value of a plain job
                result = runner.run(jobs.layout_then_job, tag="connect", then=dataset_jobs.shard_job, batch_size=8)
                out["result"], shards = result["layout"], result["then"]
            else:
                shards = runner.run(dataset_jobs.shard_job, batch_size=8)
            out["dataset-" + launcher] = {"result": shards, "dataframe": type(dataset).__module__}
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
