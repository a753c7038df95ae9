"""The supervisor's decisions, fed a sequence of events and made-up times: no Spark, no sockets."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from airflow_provider_horovod.runner.driver.attempt import checked_plan
from airflow_provider_horovod.runner.events import (
    CancelRequested,
    Failure,
    FactsReported,
    JobEnded,
    RankFailed,
    TaskFinished,
    TaskLost,
    TaskReady,
    TaskStarted,
    UploadFinished,
    UploadStarted,
)
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan
from tests.plans import task_facts
from airflow_provider_horovod.runner.driver.supervisor import (
    CutOff,
    Deadlines,
    PlanError,
    Release,
    SendPlan,
    SendStart,
    Stop,
    Supervisor,
)

D = Deadlines(start_s=30.0)


def facts(partition: int) -> TaskFacts:
    return task_facts(partition, address="127.0.0.1", pid=1, task_dir="/t%d" % partition)


def supervisor(np: int = 2, planner=make_plan) -> Supervisor:
    return Supervisor(np, coordinated=True, planner=planner, deadlines=D, now=0.0)


def launched(np: int = 2) -> Supervisor:
    """A supervisor whose tasks all reported, got the plan, got ready and were started."""
    sup = supervisor(np)
    for p in range(np):
        sup.handle(TaskStarted(p, "e:1"), 0.1)
        sup.handle(FactsReported(facts(p)), 0.2)
    for p in range(np):
        sup.handle(TaskReady(p), 0.3)
    assert sup.phase == "running"
    return sup


def boom(rank: int = 1) -> Failure:
    return Failure("Rank %d failed: ValueError: boom" % rank, rank=rank, exception="ValueError: boom")


def test_the_plan_goes_out_only_when_every_task_reported_and_start_only_when_all_are_ready():
    sup = supervisor()
    assert sup.handle(FactsReported(facts(1)), 0.1) == []
    [action] = sup.handle(FactsReported(facts(0)), 0.2)
    assert isinstance(action, SendPlan) and [s.partition for s in action.plan.slots] == [0, 1]
    assert sup.handle(TaskReady(0), 0.3) == []
    assert sup.handle(TaskReady(1), 0.4) == [SendStart()]
    assert sup.marks["facts"] == 0.2 and sup.marks["start"] == 0.4


def test_a_clean_run_releases_the_tasks_when_all_finished_and_ends_with_the_job():
    sup = launched()
    assert sup.handle(TaskFinished(1), 5.0) == []
    assert sup.handle(TaskFinished(0), 5.1) == [Release()]
    assert not sup.done
    sup.handle(JobEnded(value=[]), 5.2)
    assert sup.done and sup.reason is None and sup.cause is None


def test_facts_that_cannot_run_stop_the_run_with_their_reason():
    def planner(_facts):
        raise PlanError(Failure("Python 3.10 on executor e:1 differs from the driver's 3.11.2."))

    sup = supervisor(planner=planner)
    sup.handle(FactsReported(facts(0)), 0.1)
    assert sup.handle(FactsReported(facts(1)), 0.2) == [Stop()]
    assert sup.reason == "error" and "differs from the driver's" in sup.cause.message


def test_a_slow_start_stops_the_run_at_start_timeout_not_before():
    sup = supervisor()
    sup.handle(FactsReported(facts(0)), 1.0)
    assert sup.tick(29.9) == []
    assert sup.tick(30.1) == [Stop()]
    assert sup.reason == "timeout"


def test_the_first_failure_is_the_cause_and_what_follows_the_stop_is_not():
    sup = launched()
    assert sup.handle(RankFailed(boom(1)), 2.0) == [Stop()]
    killed = Failure("Rank 0 was killed by SIGTERM after the job was told to stop", rank=0, consequence=True)
    sup.handle(TaskFinished(0, killed), 2.5)
    assert sup.handle(TaskFinished(1, boom(1)), 2.6) == [Release()]
    assert sup.cause.rank == 1 and sup.reason == "error"


def test_a_peer_whose_collective_broke_is_not_the_cause_even_when_it_reports_first():
    sup = launched()
    broken = Failure("Rank 0 failed: HorovodInternalError: Horovod has been shut down.", rank=0,
                     exception="HorovodInternalError: Horovod has been shut down.")
    assert sup.handle(RankFailed(broken), 2.0) == [Stop()]
    died = Failure("Rank 1 on host hvdhost0 was killed by SIGKILL", rank=1, exit="was killed by SIGKILL")
    sup.handle(TaskFinished(1, died), 2.1)
    assert sup.cause.rank == 1


def test_error_then_hang_cuts_the_tasks_off_after_the_stop_grace():
    sup = launched()
    sup.handle(RankFailed(boom()), 10.0)
    assert sup.tick(10.0 + D.stop_grace_s - 0.1) == []
    assert sup.tick(10.0 + D.stop_grace_s + 0.1) == [CutOff()]
    assert sup.tick(10.0 + D.stop_grace_s + 1) == []  # cut off once
    sup.handle(JobEnded(error=RuntimeError("interrupted")), 31.0)
    assert sup.done and sup.cause.rank == 1


def test_an_upload_in_flight_after_a_failure_gets_the_artifact_grace():
    sup = launched()
    sup.handle(RankFailed(boom()), 10.0)
    sup.handle(UploadStarted(), 11.0)
    assert sup.tick(10.0 + D.stop_grace_s + 1) == []
    assert sup.tick(10.0 + D.artifact_grace_s + 0.1) == [CutOff()]


def test_cancel_during_upload_cuts_off_within_the_cancel_bound():
    sup = launched()
    sup.handle(UploadStarted(), 4.0)
    assert sup.handle(CancelRequested(), 5.0) == [Stop()]
    assert sup.tick(5.0 + D.cancel_grace_s + 0.1) == []  # the upload gets its short extra grace
    cut = 5.0 + D.cancel_grace_s + D.cancel_artifact_grace_s
    assert sup.tick(cut + 0.1) == [CutOff()]
    assert cut - 5.0 < D.cancel_bound_s
    assert sup.reason == "cancel"


def test_cancel_after_an_error_shortens_the_grace():
    sup = launched()
    sup.handle(RankFailed(boom()), 10.0)
    assert sup.handle(CancelRequested(), 11.0) == []  # already stopping: no second stop
    assert sup.reason == "cancel"
    assert sup.tick(10.0 + D.cancel_grace_s + 0.1) == [CutOff()]


def test_an_upload_that_finished_is_not_waited_for():
    sup = launched()
    sup.handle(UploadStarted(), 1.0)
    sup.handle(UploadFinished(), 2.0)
    sup.handle(RankFailed(boom()), 3.0)
    assert sup.tick(3.0 + D.stop_grace_s + 0.1) == [CutOff()]


def test_a_task_lost_before_it_finished_is_a_failure_and_after_is_nothing():
    sup = launched()
    sup.handle(TaskFinished(0), 5.0)
    assert sup.handle(TaskLost(0), 5.1) == []
    assert sup.handle(TaskLost(1), 5.2) == [Stop()]
    assert "partition 1 on host hvdhost0 (executor e:1) died" in sup.cause.message


def test_a_job_that_never_returns_after_the_cut_off_is_given_up():
    sup = launched()
    sup.handle(CancelRequested(), 1.0)
    sup.tick(1.0 + D.cancel_grace_s + 0.1)
    assert not sup.done
    sup.tick(1.0 + D.cancel_grace_s + D.cut_off_join_s + 1)
    assert sup.done and sup.job_ended is None


def test_a_run_without_the_channel_ends_with_its_job():
    sup = Supervisor(0, coordinated=False, planner=make_plan, deadlines=D, now=0.0)
    assert sup.phase == "running" and sup.tick(D.start_s + 1) == []  # no start deadline to watch
    sup.handle(JobEnded(value=b"x"), 2.0)
    assert sup.done and sup.job_ended.value == b"x"


def test_a_rank_failure_of_a_run_on_the_driver_is_placed_on_the_driver_whichever_way_it_came():
    # np < 0: the supervisor has no plan; a rank's report over the channel says nothing of where it ran
    # (issue 49), and its error file is placed by the local plan: both read the same (no race in the words)
    sup = Supervisor(0, coordinated=False, planner=make_plan, deadlines=D, now=0.0, here=("hvdhost0", "driver"))
    sup.handle(RankFailed(Failure("Rank 1 failed: ValueError: x", rank=1, exception="ValueError: x")), 1.0)
    failure = sup.failures[0]
    assert (failure.host, failure.executor) == ("hvdhost0", "driver")
    assert failure.message == "Rank 1 on host hvdhost0 (executor driver) failed: ValueError: x"


def test_next_wakeup_is_the_nearest_deadline_and_never_long():
    sup = launched()
    assert sup.next_wakeup(1.0) == 1.0
    sup.handle(CancelRequested(), 1.0)
    assert sup.next_wakeup(5.9) == pytest.approx(0.1)


def test_deadlines_refuse_a_cancel_grace_that_breaks_the_ten_second_promise():
    with pytest.raises(AssertionError):
        Deadlines(cancel_grace_s=8.0)
    with pytest.raises(ValueError, match="start_timeout"):
        Deadlines(start_s=0)


def test_a_lost_task_is_named_by_its_host_and_executor():
    sup = launched()
    sup.handle(TaskLost(1), 5.2)
    slot = sup.plan.for_partition(1)
    assert "host %s (executor %s)" % (slot.hostname, slot.executor) in sup.cause.message
    assert sup.cause.host == slot.hostname and sup.cause.executor == slot.executor


def test_a_tasks_own_report_in_the_stage_error_comes_before_the_tasks_spark_aborted_for_it():
    sup = supervisor()
    sup.handle(TaskStarted(0, "a:1"), 0.1)
    sup.handle(TaskLost(0), 2.0)  # Spark aborted the stage: partition 1 could not reach the channel
    unreachable = Failure("The barrier task of partition 1 cannot reach the driver's channel at 10.0.0.1:4242")
    sup.handle(JobEnded(error=RuntimeError("stage failed"), failure=unreachable), 3.0)
    assert sup.done and sup.cause is unreachable



def test_a_machine_lost_that_spark_reports_first_is_still_named_by_the_task_the_channel_lost():
    sup = launched()
    assert sup.handle(JobEnded(error=RuntimeError("ExecutorLostFailure: Remote RPC client disassociated")), 5.0) == []
    assert not sup.done and sup.next_wakeup(5.0) <= D.lost_task_grace_s
    sup.handle(RankFailed(dataclasses.replace(boom(1), exception="HorovodInternalError: a peer went away")), 5.1)
    assert not sup.done  # rank 1's collective broke because of the loss: that does not explain it
    sup.handle(TaskLost(0), 5.2)
    slot = sup.plan.for_partition(0)
    assert sup.done and "partition 0 on host %s (executor %s) died" % (slot.hostname, slot.executor) in \
        sup.cause.message


def test_a_job_failure_nothing_explains_ends_the_run_after_the_lost_task_grace():
    sup = launched()
    sup.handle(JobEnded(error=RuntimeError("stage failed")), 5.0)
    assert sup.tick(5.0 + D.lost_task_grace_s - 0.1) == [] and not sup.done
    sup.tick(5.0 + D.lost_task_grace_s)
    assert sup.done and sup.cause is None and sup.reason is None


def test_a_job_failure_after_a_rank_failed_ends_the_run_at_once():
    sup = launched()
    sup.handle(RankFailed(boom(1)), 5.0)
    sup.handle(JobEnded(error=RuntimeError("stage failed")), 5.1)
    assert sup.done and sup.cause.message.startswith("Rank 1 on host hvdhost0 (executor e:1) failed")  # placed by the plan

DRIVER_STACK = {"provider": "0.1.0", "horovod": "horovod 0.28.1 (pytorch 2.13.0+cpu; MPI, Gloo)"}


def checked(np: int = 2) -> Supervisor:
    return supervisor(np, planner=functools.partial(checked_plan, "3.11.2", DRIVER_STACK))


def test_executors_with_the_drivers_provider_version_and_horovod_build_get_the_plan():
    sup = checked()
    sup.handle(FactsReported(dataclasses.replace(facts(0), **DRIVER_STACK)), 0.1)
    [action] = sup.handle(FactsReported(dataclasses.replace(facts(1), **DRIVER_STACK)), 0.2)
    assert isinstance(action, SendPlan)


def test_an_executor_with_another_provider_version_is_refused_before_any_rank_starts_naming_it():
    sup = checked()
    sup.handle(FactsReported(dataclasses.replace(facts(0), **DRIVER_STACK)), 0.1)
    other = dataclasses.replace(facts(1), executor="10.0.3.12:48638", **{**DRIVER_STACK, "provider": "0.0.9"})
    assert sup.handle(FactsReported(other), 0.2) == [Stop()]
    assert sup.plan is None and sup.reason == "error"
    assert sup.cause.error_class == "ExecutorMismatchError" and sup.cause.executor == "10.0.3.12:48638"
    assert "executor 10.0.3.12:48638 (partition 1)" in sup.cause.message
    assert "airflow-provider-horovod 0.0.9 here, 0.1.0 on the driver" in sup.cause.message
    assert "spark.archives" in sup.cause.message


def test_an_executor_whose_horovod_lacks_gloo_is_refused_naming_both_builds():
    sup = checked()
    built = "horovod 0.28.1 (pytorch 2.13.0+cpu; MPI)"
    sup.handle(FactsReported(dataclasses.replace(facts(0), **{**DRIVER_STACK, "horovod": built})), 0.1)
    sup.handle(FactsReported(dataclasses.replace(facts(1), **DRIVER_STACK)), 0.2)
    assert sup.plan is None and sup.cause.error_class == "ExecutorMismatchError"
    assert "Horovod %s here, %s on the driver" % (built, DRIVER_STACK["horovod"]) in sup.cause.message
    assert "(partition 0)" in sup.cause.message
