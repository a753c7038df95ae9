"""Runs one np=2 job in a fresh SparkSession built from a master URL and Spark conf.

usage: python -m tests.integration.scenarios.one_run MASTER CONF_JSON OUT_JSON

Writes the error type and message (or the result) and how many Spark jobs ran, for settings that
need a session of their own (executors on another Python, dynamic allocation, ...).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    master, conf, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner
    from tests.integration import jobs

    builder = SparkSession.builder.master(master).config("spark.ui.enabled", "false")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        result = HorovodRunner(2, spark=spark, start_timeout=60).run(jobs.allreduce_job)
        got = {"error_type": None, "message": None, "result": result}
    except Exception as err:  # noqa: BLE001
        got = {"error_type": type(err).__name__, "message": str(err)}
    got["spark_jobs"] = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    spark.stop()
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
