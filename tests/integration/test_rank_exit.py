"""A rank's end: quick, and nothing of what a normal interpreter exit does is skipped. The warm process
freezes what its imports made (``gc.freeze``) before it forks, and every rank freezes what is left once its
work is done, so the exit's collections do not walk torch's and Horovod's objects (0.5 cpu-s of a 0.75 s
exit, per rank); a non-daemon thread is still waited for, ``atexit`` handlers still run, and a file the
training left open still gets its last write. Real Spark, Gloo and Horovod ranks, forked and cold."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner
from tests.integration import warm_jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_rank_ends_with_its_threads_atexit_handlers_and_open_files_done(spark, tmp_path, warm):
    frozen = HorovodRunner(2, launcher="gloo", spark=spark, env={"HVDRUNNER_WARM": warm}).run(
        warm_jobs.exit_duties_job, str(tmp_path))
    for rank in (0, 1):
        for duty in ("unclosed", "atexit", "thread"):
            assert (tmp_path / ("%s-%d.txt" % (duty, rank))).read_text() == duty
    if warm == "1":
        assert frozen > 0  # forked from a warm process that froze the imported training stack
    else:
        assert frozen == 0  # a fresh interpreter: nothing frozen before the function
