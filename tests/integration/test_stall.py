"""A try in which no rank makes progress for ``stall_timeout`` ends, naming the stalled rank, where it
is (its user frame, or what the OS says of it), the tensor it left waiting where Horovod knows it,
with every rank's stacks; under every launcher, and nothing is left running."""

from __future__ import annotations

import time

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner, StallError
from airflow_provider_horovod.runner.driver import versions
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
    # Horovod names the tensors it found waiting in its newest report: rank 0's gradient that rank 1 never
    # submitted, or rank 1's epoch loss that rank 0 never submitted, or both; which of the two it had
    # found when the driver's rule ended the try is a matter of its response cache and milliseconds (under
    # load, either). Where each rank is says the rest, and that is exact:
    assert ("rank 1 never submitted allreduce.grad.fc1" in first_line
            or "rank 0 never submitted allreduce.epoch_loss" in first_line), first_line
    grad_line = jobs.uneven_batches_job.__code__.co_firstlineno + 15
    assert "rank 0 waits in allreduce (called at uneven_batches_job (jobs.py:%d))" % grad_line in first_line
    assert "rank 1 waits in allreduce (called at uneven_batches_job (jobs.py:%d))" % (grad_line + 4) in first_line
    assert "(waited %d s)" % STALL_TIMEOUT_S in first_line
    assert runner.last_run.status == "failed"
    _, newest = versions.committed(tmp_path / "a")[-1]
    assert (newest / "step.txt").read_text() == "3"  # rank 1's last batch: the newest version is whole
    retry = HorovodRunner(2, launcher=launcher, spark=spark, stall_timeout=STALL_TIMEOUT_S, resume_from=newest)
    assert retry.run(jobs.uneven_batches_job, batches=6, short_by=0) == {"start": 4}


@pytest.mark.parametrize("how", ["sleep", "sigstop"])
@pytest.mark.parametrize("launcher", ["mpirun", "gloo", "torch"])
def test_a_rank_that_stalls_at_step_3_fails_the_try_naming_it_and_where_it_is(spark, tmp_path, launcher, how):
    marker = tmp_path / "stalled-at"
    runner = HorovodRunner(2, launcher=launcher, spark=spark, stall_timeout=STALL_TIMEOUT_S)
    with pytest.raises(StallError) as caught:
        runner.run(jobs.stalling_job, collective="torch" if launcher == "torch" else "horovod", how=how,
                   marker=str(marker))
    took = time.time() - float(marker.read_text())
    text = str(caught.value)
    print("took %.1f s:\n%s" % (took, text))  # pytest -rP shows it
    first_line = text.splitlines()[0]
    assert took < 1.25 * STALL_TIMEOUT_S + 10, (took, text[:3000])
    assert first_line.startswith("stalled: rank 1 "), text[:3000]
    assert "rank 0 waits in" in first_line
    if how == "sleep":
        line = jobs.sleeps_in_user_code.__code__.co_firstlineno + 1
        assert "rank 1 in user code at sleeps_in_user_code (jobs.py:%d)" % line in first_line
        assert 'line %d, in sleeps_in_user_code' % line in text  # its stack, with the user's frames
        assert not caught.value.unresponsive  # a bug: no restart, no retry
    else:
        assert "rank 1 is stopped" in first_line
        assert caught.value.unresponsive  # the infrastructure: restarts and retries
    if launcher != "torch" and how == "sleep":  # (a stopped rank also stops Horovod's coordination: no words)
        assert "rank 1 never submitted allreduce.grad.step (waited %d s)" % STALL_TIMEOUT_S in first_line
    assert runner.last_run.error["traceback"].startswith("Python stacks at the stall")  # the view's failure panel
    assert runner.last_run.error["message"] == first_line


def test_a_stopped_rank_is_lost_infrastructure_and_the_try_restarts_and_finishes(spark, tmp_path):
    runner = HorovodRunner(2, launcher="torch", spark=spark, stall_timeout=STALL_TIMEOUT_S, max_restarts=1)
    assert runner.run(jobs.stalling_job, collective="torch", how="sigstop", marker=str(tmp_path / "at"), attempts=1) == 5
    first, second = runner.last_run.attempts_json()
    assert first["ending"] == "lost" and first["cause"].startswith("stalled: rank 1 is stopped"), first
    assert second["ending"] == "success"
