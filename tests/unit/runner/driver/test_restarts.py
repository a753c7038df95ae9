"""The restart policy (``driver/restarts.py``): how an attempt ended and whether another one starts,
from what the supervisor decided, without Spark. The restarts themselves run in
tests/integration/test_restarts.py and tests/integration/test_cluster.py."""

from __future__ import annotations

import types

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.runner.driver.restarts import (
    AttemptRecord,
    Ending,
    RestartPolicy,
    RestartSize,
    attempts_text,
    ending_of,
)
from airflow_provider_horovod.runner.driver.capacity import can_grow, worker_decommissioned
from airflow_provider_horovod.runner.driver.supervisor import Supervisor
from airflow_provider_horovod.runner.events import Failure, JobEnded, RankFailed, TaskLost
from airflow_provider_horovod.runner.options import check_restarts
from airflow_provider_horovod.runner.plan import make_plan
from tests.unit.runner.driver.test_supervisor import D, launched


def supervised(*events) -> Supervisor:
    """A two-task supervisor whose ranks run, then saw ``events`` (at t=10)."""
    sup = launched()
    for event in events:
        sup.handle(event, 10.0)
    return sup


def ended(sup: Supervisor, job_error: BaseException | None = None, cancelled: bool = False) -> Ending:
    return ending_of(cancelled=cancelled, reason=sup.reason, cause=sup.cause, job_error=job_error)


def test_a_task_the_channel_lost_is_lost_infrastructure_and_restarts():
    sup = supervised(TaskLost(1))
    assert sup.cause.lost and ended(sup) == Ending.LOST
    assert RestartPolicy(max_restarts=1).restarts(Ending.LOST, 0)


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM", "SIGHUP", "SIGINT"])
def test_a_rank_killed_from_outside_is_lost_infrastructure(signal_name):
    killed = Failure("Rank 1 on host hvdhost1 was killed by %s" % signal_name, rank=1, exit="was killed by %s" % signal_name)
    assert ended(supervised(RankFailed(killed))) == Ending.LOST


@pytest.mark.parametrize("exit_", ["was killed by SIGSEGV", "was killed by SIGABRT", "exited with code 1"])
def test_a_rank_that_crashed_or_exited_by_itself_never_restarts(exit_):
    crashed = Failure("Rank 1 %s" % exit_, rank=1, exit=exit_)
    assert ended(supervised(RankFailed(crashed))) == Ending.FAILED
    assert not RestartPolicy(max_restarts=5).restarts(Ending.FAILED, 0)


def test_a_user_exception_fails_even_when_a_task_is_lost_after_it():
    raised = Failure("Rank 1 raised ValueError: boom", rank=1, exception="ValueError: boom")
    assert ended(supervised(RankFailed(raised), TaskLost(0))) == Ending.FAILED


def test_a_peer_whose_collective_broke_before_the_loss_was_seen_does_not_hide_the_loss():
    broke = Failure("Rank 0 raised HorovodInternalError", rank=0, exception="HorovodInternalError: peer gone")
    assert ended(supervised(RankFailed(broke), TaskLost(1))) == Ending.LOST


def test_a_job_spark_failed_for_a_lost_executor_restarts_and_any_other_job_error_does_not():
    sup = Supervisor(2, coordinated=False, planner=make_plan, deadlines=D, now=0.0)
    sup.handle(JobEnded(error=RuntimeError("ExecutorLostFailure (executor 1 exited caused by one of the running tasks)")), 5.0)
    assert ended(sup, sup.job_ended.error) == Ending.LOST
    assert ended(sup, RuntimeError("AnalysisException: no such table")) == Ending.FAILED


def test_a_cancel_never_restarts_whatever_was_lost():
    assert ended(supervised(TaskLost(1)), cancelled=True) == Ending.CANCELLED
    assert not RestartPolicy(max_restarts=3).restarts(Ending.CANCELLED, 0)


def test_restarts_stop_at_max_restarts_and_none_by_default():
    policy = RestartPolicy(max_restarts=2)
    assert [policy.restarts(Ending.LOST, done) for done in range(3)] == [True, True, False]
    assert not RestartPolicy().restarts(Ending.LOST, 0)


def size(policy: RestartPolicy, slots: int | None, *, waited: float = 0.0, minimum_for: float | None = None,
         can_grow: bool = True, np: int = 4) -> RestartSize:
    return policy.restart_size(np, slots, waited_s=waited, minimum_for_s=minimum_for, can_grow=can_grow,
                               start_timeout_s=120.0)


def test_a_restart_with_np_slots_or_a_session_that_cannot_count_them_starts_at_once_on_np():
    policy = RestartPolicy(max_restarts=1, min_np=2)
    assert [size(policy, slots).np for slots in (None, 5, 4)] == [4, 4, 4]


def test_a_restart_with_min_np_slots_waits_the_last_call_for_the_rest_not_start_timeout():
    policy = RestartPolicy(max_restarts=1, min_np=2, last_call_s=30.0)
    assert size(policy, 3, waited=5.0, minimum_for=5.0) == RestartSize()  # waits
    assert size(policy, 3, waited=31.0, minimum_for=29.9) == RestartSize()  # the minimum came 1.1 s in
    assert size(policy, 3, waited=40.0, minimum_for=30.0) == RestartSize(np=3, why="no more came within last_call=30s")
    assert size(policy, 2, waited=30.0, minimum_for=30.0).np == 2
    # a last call longer than what is left of start_timeout ends with it
    assert size(RestartPolicy(min_np=2, last_call_s=600.0), 3, waited=120.0, minimum_for=60.0).np == 3


def test_a_restart_on_a_cluster_that_cannot_gain_slots_starts_at_once_on_min_np_or_fails_at_once_below():
    policy = RestartPolicy(max_restarts=1, min_np=2)
    assert size(policy, 3, minimum_for=0.0, can_grow=False) == RestartSize(np=3, why="the cluster cannot gain slots")
    assert size(policy, 1, can_grow=False) == RestartSize(fail=True, why="the cluster cannot gain slots")


def test_a_restart_below_min_np_waits_start_timeout_then_fails_and_min_np_defaults_to_np():
    policy = RestartPolicy(max_restarts=1, min_np=2)
    assert size(policy, 1, waited=119.0) == RestartSize()
    assert size(policy, 1, waited=120.0).fail
    never_fewer = RestartPolicy(max_restarts=1)  # min_np defaults to np: the last call never starts fewer
    assert size(never_fewer, 3, waited=100.0, minimum_for=None) == RestartSize()
    assert size(never_fewer, 3, waited=120.0).fail


@pytest.mark.parametrize("last_call", [-1, True, float("inf"), "30"])
def test_a_bad_last_call_is_refused_when_the_runner_is_made(last_call):
    with pytest.raises(ValueError, match="last_call must be a number of seconds >= 0"):
        HorovodRunner(2, max_restarts=1, min_np=1, last_call=last_call)


def test_the_error_after_restarts_names_every_attempt_and_why_it_ended():
    records = [AttemptRecord(number=0, np=2, started_s=0.0, ending=Ending.LOST, cause="The barrier task of partition 1 died"),
               AttemptRecord(number=1, np=2, started_s=9.0, resumed_from={"seq": 4, "step": 7}, ending=Ending.LOST,
                             cause="Rank 1 was killed by SIGKILL")]
    assert attempts_text(records, 1).splitlines() == [
        "The run made 2 attempts (max_restarts=1):",
        "  attempt 0 (2 ranks): lost: The barrier task of partition 1 died",
        "  attempt 1 (2 ranks, resumed from version 4 (step 7)): lost: Rank 1 was killed by SIGKILL",
    ]
    assert AttemptRecord.from_json(records[1].to_json()) == records[1]


@pytest.mark.parametrize(("max_restarts", "min_np", "np", "words"), [
    (-1, None, 2, "max_restarts must be an int >= 0"),
    (True, None, 2, "max_restarts must be an int >= 0"),
    (1, 0, 2, "min_np must be an int >= 1"),
    (1, 3, 2, "min_np=3 is more than np=2"),
    (1, 1, -2, "min_np needs np > 0"),
])
def test_bad_restart_options_are_refused_when_the_runner_is_made(max_restarts, min_np, np, words):
    with pytest.raises(ValueError, match=words):
        check_restarts(max_restarts, min_np, np)
    with pytest.raises(ValueError, match=words):
        HorovodRunner(np, max_restarts=max_restarts, min_np=min_np)


class _Session:
    """What ``capacity`` reads of a session: its master (YARN and Kubernetes cannot run here)."""

    def __init__(self, master: str) -> None:
        self.sparkContext = types.SimpleNamespace(master=master)


def test_the_missing_slots_cannot_come_on_a_local_master_nor_from_a_standalone_worker_spark_decommissioned():
    assert not can_grow(_Session("local[2]"), [])
    assert can_grow(_Session("spark://127.0.0.1:7077"), [])  # a worker that died without notice may come back
    assert not can_grow(_Session("spark://127.0.0.1:7077"), ["3"])  # its worker decommissioned with executor 3
    assert can_grow(_Session("yarn"), ["3"]) and can_grow(_Session("k8s://https://api:6443"), ["3"])  # new nodes
    assert not worker_decommissioned(_Session("spark://127.0.0.1:7077"), "3")  # a session that cannot say: no
