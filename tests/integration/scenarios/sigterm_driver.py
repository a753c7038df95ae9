"""A driver that trains until it is sent SIGTERM.

usage: python -m tests.integration.scenarios.sigterm_driver LAUNCHER NP MARKER
"""

from __future__ import annotations

import sys


def main() -> None:
    launcher, np, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from airflow_provider_horovod import HorovodRunner, RunCancelledError
    from tests.integration import jobs

    spark = None
    if np > 0:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    try:
        HorovodRunner(np, launcher=launcher, spark=spark).run(jobs.slow_job, steps=100000, marker=marker)
    except RunCancelledError as err:
        print("CANCELLED: %s" % err, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
