"""Runs one np=2 job on local[2] whose executors run another interpreter, given as spark.pyspark.python.

usage: python tests/integration/scenarios/bare_executor.py PYTHON OUT_JSON

Started by path, from a folder without this repository, and with no PYTHONPATH, so that the
executors (which inherit the driver's environment and folder) find this package only if PYTHON has it.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    python, out = sys.argv[1], sys.argv[2]
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.pyspark.python", python).getOrCreate())
    try:
        HorovodRunner(2, spark=spark, start_timeout=60).run(lambda: 1)
        got = {"error_type": None, "message": None}
    except Exception as err:  # noqa: BLE001
        got = {"error_type": type(err).__name__, "message": str(err)}
    spark.stop()
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
