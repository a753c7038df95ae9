"""Restarts inside the same ``run()`` on the shared ``local[2]`` session: a rank kills its barrier
task's Python worker (the driver's channel loses the task, as when an executor or host goes). The
executor JVM killed on a standalone cluster is in tests/integration/test_cluster.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner, RunCancelledError
from airflow_provider_horovod.runner.driver.versions import committed
from tests.integration import jobs

pytestmark = pytest.mark.slow


def test_restarts_run_out_with_an_error_naming_every_attempts_cause_and_the_versions_stay(spark, tmp_path,
                                                                                          no_leftover_processes):
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=tmp_path, max_restarts=1)
    with pytest.raises(HorovodRunError) as info:
        runner.run(jobs.restartable_job, loss="task", losses=2)
    text = str(info.value)
    assert "The run made 2 attempts (max_restarts=1):" in text
    assert "  attempt 0 (2 ranks): lost: The barrier task of partition 1" in text
    assert "  attempt 1 (2 ranks, resumed from version " in text and text.count("died") >= 3
    first, second = runner.last_run.attempts_json()
    assert (first["ending"], second["ending"]) == ("lost", "lost")
    steps = [v["step"] for v in runner.last_run.checkpoints if v["step"] is not None]
    assert second["resumed_from"]["step"] >= 3 and max(steps) >= second["resumed_from"]["step"] + 3
    assert committed(tmp_path)[-1][0].step == max(steps)  # the newest version is still there, on the driver


def test_a_task_told_to_terminate_tells_every_rank_and_the_restart_resumes_from_the_version_committed_for_it(
        spark, tmp_path, no_leftover_processes):
    """SIGTERM to rank 1's barrier task (YARN preempting its container, a batch scheduler's job end):
    every rank sees runtime.preempting(), rank 0 commits the step they agreed on, the task ends
    preempt_grace_s later, and the restart loses no step."""
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=tmp_path, max_restarts=1)
    runner.deadlines = dataclasses.replace(runner.deadlines, preempt_grace_s=4.0)  # rank 0's version lands well within it
    result = runner.run(jobs.preemptible_job, notice="sigterm")
    lost, restarted = runner.last_run.attempts_json()
    assert (lost["ending"], restarted["ending"]) == ("lost", "success")
    assert "was told to terminate (SIGTERM)" in lost["cause"]
    (notice,) = [e for e in runner.last_run.events if e.get("kind") == "preempting"]
    assert len(notice["executors"]) == 1
    assert [e["partition"] for e in runner.last_run.events if e.get("kind") == "terminating"] == [1]
    # the one version of attempt 0 holds the step every rank agreed the notice came (step 3 or later), and
    # the restart resumed from it: no step lost
    (version,) = [v["step"] for v in runner.last_run.checkpoints if v["step"] is not None]
    assert restarted["resumed_from"]["step"] == version >= 3
    assert result == {"start": version + 1, "attempt": 1, "size": 2}


def test_a_user_exception_fails_once_and_never_restarts(spark, no_leftover_processes):
    runner = HorovodRunner(2, launcher="gloo", spark=spark, max_restarts=2)
    with pytest.raises(HorovodRunError, match="boom from rank 1") as info:
        runner.run(jobs.failing_job, fail_rank=1)
    assert [a["ending"] for a in runner.last_run.attempts_json()] == ["failed"]
    assert "attempts" not in str(info.value)


def test_a_cancel_during_a_restart_leaves_no_process(spark, tmp_path, no_leftover_processes):
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=tmp_path, max_restarts=3)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_into(errors, runner, jobs.restartable_job, loss="task", losses=3))
    thread.start()
    deadline = time.monotonic() + 60
    while len(runner.last_run.attempts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(runner.last_run.attempts) == 2, "the first attempt was never lost"
    runner.cancel()  # the second attempt is starting: its Spark job, its tasks, perhaps its ranks
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RunCancelledError)
    assert [a["ending"] for a in runner.last_run.attempts_json()] == ["lost", "cancelled"]


class _TimedOut(BaseException):
    """What Airflow's ``execution_timeout`` raises into the task's main thread (SIGALRM), wherever it is:
    ``AirflowTaskTimeout``, a ``BaseException``."""


def _airflow_handler(runner: HorovodRunner, signum: int):
    """Airflow 3's handler of ``signum`` in a task process: SIGTERM (a cancel, "Mark failed") calls the
    operator's ``on_kill`` and returns; SIGALRM (``execution_timeout``) raises."""
    def on_signal(_signum, _frame):
        if signum == signal.SIGTERM:
            runner.cancel()
        else:
            raise _TimedOut("Timeout, PID: %d" % os.getpid())
    return on_signal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGALRM], ids=["sigterm", "execution_timeout"])
def test_a_signal_arriving_in_the_main_thread_during_a_restart_leaves_no_process(spark, tmp_path, signum,
                                                                                 no_leftover_processes):
    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=tmp_path, max_restarts=3)

    def restarting() -> bool:
        if signum == signal.SIGTERM:  # as soon as the restart began: wherever run() is in it
            return len(runner.last_run.attempts) >= 2
        # The timeout's error once the restarted attempt's ranks started (its supervisor loop): raised
        # into a py4j call of the main thread instead, it would leave that thread's connection to the
        # JVM out of step (py4j neither closes nor resets it on a BaseException) and break the shared
        # session for the tests after this one. The engine then cancels, as at any point of a try.
        attempt = runner._attempt
        return attempt is not None and attempt.number == 1 and attempt.ranks_started_at is not None

    def send_when_restarting():
        deadline = time.monotonic() + 60
        while not restarting() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)  # handled in the main thread

    previous = signal.signal(signum, _airflow_handler(runner, signum))
    sender = threading.Thread(target=send_when_restarting)
    try:
        sender.start()
        with pytest.raises(RunCancelledError if signum == signal.SIGTERM else _TimedOut):
            runner.run(jobs.restartable_job, loss="task", losses=3)
    finally:
        sender.join(60)
        signal.signal(signum, previous)
    assert [a["ending"] for a in runner.last_run.attempts_json()] == ["lost", "cancelled"]
    assert spark.range(3).count() == 3  # the shared session still answers


def _run_into(errors: list[BaseException], runner: HorovodRunner, job, **kwargs) -> None:
    try:
        runner.run(job, **kwargs)
    except BaseException as err:  # noqa: BLE001
        errors.append(err)
