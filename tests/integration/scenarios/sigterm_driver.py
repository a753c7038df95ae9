"""A driver that trains, step after step, until each run is interrupted (SIGTERM, or Ctrl-C).

usage: python -m tests.integration.scenarios.sigterm_driver STEPS MARKERS
STEPS: runs as LAUNCHER:NP, comma-separated. Run i touches MARKERS/step-<i> once it trains; the
driver prints ``CANCELLED <i>: ...`` when the run is cancelled, then waits for a line on stdin
before the next run. It exits with 3 after the last run was cancelled.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    steps = [(word.split(":")[0], int(word.split(":")[1])) for word in sys.argv[1].split(",")]
    markers = Path(sys.argv[2])
    from airflow_provider_horovod import HorovodRunner, RunCancelledError
    from tests.integration import jobs, torch_jobs

    spark = None
    if any(np > 0 for _, np in steps):
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    for i, (launcher, np) in enumerate(steps):
        if i:
            sys.stdin.readline()
        job = torch_jobs.slow_ddp_job if launcher == "torch" else jobs.slow_job
        try:
            HorovodRunner(np, launcher=launcher, spark=spark).run(job, steps=100000, marker=str(markers / ("step-%d" % i)))
        except RunCancelledError as err:
            print("CANCELLED %d: %s" % (i, err), flush=True)
            continue
        print("NOT CANCELLED %d" % i, flush=True)
        sys.exit(1)
    sys.exit(3)


if __name__ == "__main__":
    main()
