"""An np=2 run on the standalone cluster when only one worker is up (``cluster_runs.py`` runs it last,
after the host-loss run left one worker): the second worker starts only when the test starts it
(``LATE_S`` into the run, 10 s), and the run waits for its executor within start_timeout.

``run_late`` writes ``late-started`` into OUT_DIR when ``run()`` is called (the test starts the worker
``LATE_S`` after the time in it), and returns the result (or error), the seconds ``run()`` took and
the engine's log lines.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

STARTED = "late-started"


def run_late(spark, out: Path) -> dict:
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import jobs

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("airflow_provider_horovod")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        (out / (STARTED + ".tmp")).write_text(str(time.time()))
        os.replace(out / (STARTED + ".tmp"), out / STARTED)  # whole when the test sees it
        started = time.monotonic()
        try:
            got = {"result": HorovodRunner(2, launcher="gloo", spark=spark, start_timeout=60).run(jobs.allreduce_job)}
        except Exception as err:  # noqa: BLE001
            got = {"error": "%s: %s" % (type(err).__name__, err)}
        got.update(run_s=time.monotonic() - started, log=lines)
    finally:
        logger.removeHandler(handler)
    return got
