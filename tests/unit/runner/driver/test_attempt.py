"""An attempt's verdict (``driver/attempt.py``): from where the supervisor ended to what ``run()``
returns or raises, without Spark. The runs themselves are in tests/integration/test_runner.py."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import cloudpickle
import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner, InsufficientSlotsError, RunCancelledError
from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.attempt import Attempt
from airflow_provider_horovod.runner.events import CancelRequested, Failure, JobEnded, RunReport
from airflow_provider_horovod.runner.exits import TaskFailure
from airflow_provider_horovod.runner.task.barrier import result_rows
from tests.security.attacker import settle


def attempt(np: int = 2, **options) -> Attempt:
    runner = HorovodRunner(np, start_timeout=3, **options)
    return Attempt(runner.attempt_options(), runner.session, threading.Event(), "r1", b"payload",
                   RunReport(run_id="r1", np=np, launcher=runner.launcher), None, None)


def ended(reason: str | None = None, cause: Failure | None = None, job: JobEnded | None = None, started=()):
    return SimpleNamespace(reason=reason, cause=cause, failures=[cause] if cause else [], job_ended=job,
                           started=set(started))


def test_each_attempt_has_its_own_secret_and_channel():
    first, second = attempt(), attempt()
    assert first.secret != second.secret and first.channel is not second.channel


def test_a_late_task_of_a_lost_attempt_is_refused_by_the_next_attempts_channel():
    lost, restart = attempt(), attempt()
    restart = Attempt(restart.options, restart.session, restart.cancelled, "r1", b"payload", restart.report, None, None,
                      number=1)
    address = restart.channel.start("127.0.0.1")
    try:
        with pytest.raises(ConnectionError):
            wire.connect(address, wire.Credentials.of(lost.secret, wire.ROLE_TASK), timeout=3)
        assert settle(lambda: restart.channel.rejected == 1)
        assert restart.run_id == "r1-1"  # its own task folders and job tag
    finally:
        restart.close()


def test_a_cancel_is_a_cancel_whatever_else_ended():
    one = attempt()
    one.cancelled.set()
    with pytest.raises(RunCancelledError):
        one._outcome(ended(cause=Failure("boom", rank=1)), one.channel)


def test_too_few_tasks_started_names_the_count_the_timeout_and_the_slots():
    one = attempt(np=4)
    one.slots = 2
    with pytest.raises(InsufficientSlotsError, match=r"Only 1 of 4 barrier tasks started within start_timeout=3.0s\. "
                                                     r"The cluster has 2 slots available"):
        one._outcome(ended(reason="timeout", started={0}), one.channel)


def test_the_first_failure_becomes_the_users_error_and_the_run_reports_it():
    one = attempt()
    with pytest.raises(HorovodRunError) as info:
        one._outcome(ended(cause=Failure("Rank 1 failed: ValueError: x", rank=1, host="hvdhost0")), one.channel)
    assert info.value.rank == 1 and info.value.host == "hvdhost0"
    assert one.report.error["rank"] == 1


def test_a_task_failure_that_travelled_through_spark_is_that_failure():
    one = attempt()
    job = JobEnded(error=TaskFailure(Failure("Rank 0 on host hvdhost0 exited with code 3", rank=0)))
    with pytest.raises(HorovodRunError, match="exited with code 3"):
        one._outcome(ended(job=job), one.channel)


def test_a_job_that_never_returned_after_the_cut_off_says_so():
    one = attempt()
    with pytest.raises(HorovodRunError, match="did not return after it was cut off"):
        one._outcome(ended(), one.channel)


def test_rank_zeros_value_comes_from_the_stage_rows_or_from_the_local_ranks():
    value = {"loss": 0.5}
    rows = result_rows(0, "result", cloudpickle.dumps(value), chunk=7)  # several chunks, put back in order
    spark = attempt()
    assert spark._outcome(ended(job=JobEnded(value=list(reversed(rows)))), spark.channel) == value
    local = attempt(np=-2)
    assert local._outcome(ended(job=JobEnded(value=cloudpickle.dumps(value))), local.channel) == value


def test_rows_without_rank_zeros_value_are_an_error():
    one = attempt()
    with pytest.raises(HorovodRunError, match="return value did not come back"):
        one._outcome(ended(job=JobEnded(value=[])), one.channel)


class _Supervisor:
    """Ends at the first cancel; its first tick asks for one action."""

    def __init__(self):
        self.done, self.ticks = False, 0

    def next_wakeup(self, now):
        return 0.01

    def handle(self, event, now):
        self.done = self.done or isinstance(event, CancelRequested)
        return []

    def tick(self, now):
        self.ticks += 1
        return ["act"] if self.ticks == 1 else []


@pytest.mark.parametrize("raised", [TimeoutError("execution_timeout"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_an_exception_raised_into_the_supervising_cancels_the_run_and_an_error_is_kept_for_its_end(raised):
    one = attempt()

    def act(_action):
        raise raised

    one._supervise(_Supervisor(), one.events, act)
    assert one.cancelled.is_set()  # the run's event: its other attempts and its restart loop see it
    assert one.interrupt is (None if isinstance(raised, KeyboardInterrupt) else raised)


def test_the_options_an_attempt_reads_are_one_frozen_value_of_the_run():
    runner = HorovodRunner(-2, start_timeout=3, driver_log_verbosity="log_callback_only", env={"A": "1"})
    options = runner.attempt_options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.np = 4
    assert (options.np, options.start_timeout, options.env) == (-2, 3.0, {"A": "1"})
    assert options.verbosity == "all"  # np < 0 shows every rank's output, whatever driver_log_verbosity says
    assert dataclasses.replace(options, np=2).verbosity == "log_callback_only"
