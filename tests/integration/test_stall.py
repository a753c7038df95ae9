"""A collective some rank never joins ends the run after ``stall_timeout``, naming that rank and the
tensor it left waiting (Horovod's own stall shutdown, under both launchers)."""

from __future__ import annotations

import time

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner
from airflow_provider_horovod.runner import versions
from tests.integration import jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]
STALL_TIMEOUT_S = 4


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])  # Gloo's stall check needs the builder's gloo_controller.cc patch
def test_uneven_batches_fail_within_the_stall_timeout_naming_the_rank_and_tensor_and_the_retry_resumes(
        spark, tmp_path, launcher):
    runner = HorovodRunner(2, launcher=launcher, spark=spark, stall_timeout=STALL_TIMEOUT_S, artifact_dir=tmp_path / "a")
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as caught:
        runner.run(jobs.uneven_batches_job, batches=6, short_by=2)
    assert time.monotonic() - started < STALL_TIMEOUT_S + 30
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith("stalled: "), str(caught.value)[:3000]
    assert "rank 1 never submitted allreduce.grad.fc1" in first_line
    assert "(waited %d s)" % STALL_TIMEOUT_S in first_line
    assert runner.last_run.status == "failed"
    _, newest = versions.committed(tmp_path / "a")[-1]
    assert (newest / "step.txt").read_text() == "3"  # rank 1's last batch: the newest version is whole
    retry = HorovodRunner(2, launcher=launcher, spark=spark, stall_timeout=STALL_TIMEOUT_S, resume_from=newest)
    assert retry.run(jobs.uneven_batches_job, batches=6, short_by=0) == {"start": 4}
