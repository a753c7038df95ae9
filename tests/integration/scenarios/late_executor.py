"""An np=2 run on a standalone cluster where only one worker is up: the second worker starts only
when the test starts it (``LATE_S`` into the run, 10 s), and the run waits for its executor within start_timeout.

usage: python -m tests.integration.scenarios.late_executor MASTER CONF_JSON OUT_DIR

Writes ``started`` when ``run()`` is called, then ``run.json``: the result (or error), the seconds
``run()`` took and the engine's log lines.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path


def main() -> None:
    master, conf, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import jobs
    from tests.integration.cluster import app_session

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("airflow_provider_horovod").addHandler(handler)
    logging.getLogger("airflow_provider_horovod").setLevel(logging.INFO)

    spark = app_session(master, conf, "hvdrunner-late-executor")
    try:
        (out / "started").write_text(str(time.time()))
        started = time.monotonic()
        try:
            got = {"result": HorovodRunner(2, launcher="gloo", spark=spark, start_timeout=60).run(jobs.allreduce_job)}
        except Exception as err:  # noqa: BLE001
            got = {"error": "%s: %s" % (type(err).__name__, err)}
        got.update(run_s=time.monotonic() - started, log=lines)
    finally:
        spark.stop()
    (out / "run.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main()
