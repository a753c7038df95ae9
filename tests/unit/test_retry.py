"""HorovodRetryPolicy: what a retry fixes is retried, what it never fixes fails at once, the rest is Airflow's."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule

from airflow_provider_horovod.exceptions import (
    ArtifactSettingsError,
    ClusterSettingsError,
    DatasetError,
    ExecutorMismatchError,
    HorovodRunError,
    InsufficientSlotsError,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
    TrainingStackError,
    rank_error,
)
from airflow_provider_horovod.retry import Cause, HorovodRetryPolicy, judge
from airflow_provider_horovod.runner.events import Failure


def _run_error(failure: Failure) -> HorovodRunError:
    """The driver's error for ``failure``, carrying the engine's report as the operator hands it on."""
    err = rank_error(failure.error_class, failure.message, rank=failure.rank, host=failure.host,
                     remote_traceback=failure.traceback or None)
    err.failure = failure.to_json()
    return err


RAISED = Failure("Rank 1 failed", rank=1, host="hvdhost1", exception="ValueError: bad learning rate",
                 traceback="Traceback (most recent call last):\nValueError: bad learning rate")


def test_an_exception_of_the_training_function_fails_at_once_naming_it_and_its_rank():
    decision = HorovodRetryPolicy().evaluate(_run_error(RAISED), try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    assert "Not retried (user code): the training function raised ValueError: bad learning rate in rank 1 on " \
           "hvdhost1" in decision.reason


@pytest.mark.parametrize("error", [
    PayloadError("cannot pickle the closure"),
    DatasetError("no such table db.events"),
    TrainingStackError("Horovod is not installed"),
    ExecutorMismatchError("Python 3.10 on the executors differs from the driver's 3.11"),
    ClusterSettingsError("Spark dynamic allocation is enabled"),
    rank_error("Keras3NotSupportedError", "Rank 0 failed: Keras 3", rank=0),
    rank_error("DatasetError", "runtime.dataset() in a run without dataset=", rank=0),
    ArtifactSettingsError("artifact_root 's3:/bucket/x' is not a URL"),
    ArtifactSettingsError("The run_id '..' cannot name a folder of the artifact store"),
])
def test_payload_dataset_environment_and_keras_3_errors_fail_at_once(error):
    decision = HorovodRetryPolicy().evaluate(error, try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    assert decision.reason.startswith("Not retried (no retry fixes it): ")
    assert str(error).split("\n")[0] in decision.reason


def test_too_few_slots_on_a_local_master_fails_at_once_since_its_slots_cannot_grow():
    from airflow_provider_horovod.exceptions import FixedSlotsError

    error = FixedSlotsError("np=3 needs 3 barrier slots, but the cluster has 2 (the master local[2])")
    decision = HorovodRetryPolicy().evaluate(error, try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    assert decision.reason.startswith("Not retried (no retry fixes it): the cluster's barrier slots cannot grow "
                                      "(FixedSlotsError: np=3 needs 3 barrier slots")


def test_too_few_slots_is_retried_after_the_slots_delay():
    error = InsufficientSlotsError("np=4 needs 4 barrier slots, but the cluster has 2")
    decision = HorovodRetryPolicy(slots_delay=timedelta(minutes=7)).evaluate(error, try_number=1, max_tries=3)
    assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, timedelta(minutes=7))
    assert "(too few slots): np=4 needs 4 barrier slots" in decision.reason
    assert HorovodRetryPolicy().evaluate(error, 1, 3).retry_delay == timedelta(minutes=5)


@pytest.mark.parametrize("failure", [
    Failure("The barrier task of partition 1 on host hvdhost1 (executor 2) died: its Python worker, its executor "
            "or that machine is gone.", host="hvdhost1", executor="2"),
    Failure("Rank 1 died", rank=1, host="hvdhost1", executor="2", exit="was killed by SIGKILL"),
])
def test_a_lost_host_or_a_rank_killed_by_a_signal_is_retried_after_the_lost_delay(failure):
    decision = HorovodRetryPolicy(lost_delay=12).evaluate(_run_error(failure), try_number=1, max_tries=3)
    assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, timedelta(seconds=12))
    assert "(lost infrastructure)" in decision.reason


@pytest.mark.parametrize("signal_name", ["SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"])
def test_a_rank_killed_by_a_signal_of_its_own_is_a_crash_and_fails_at_once(signal_name):
    crashed = Failure("Rank 1 died", rank=1, host="hvdhost1", executor="2", exit="was killed by %s" % signal_name)
    decision = HorovodRetryPolicy().evaluate(_run_error(crashed), try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    assert decision.reason.startswith("Not retried (user code): rank 1 on hvdhost1 was killed by %s, a signal of its "
                                      "own: a crash" % signal_name)


def test_a_task_s_own_retry_delay_replaces_the_policy_s_default_delays_but_not_ones_it_was_given():
    lost = _run_error(Failure("Rank 1 died", rank=1, exit="was killed by SIGKILL"))
    slots = InsufficientSlotsError("np=4 needs 4 barrier slots")
    task_own = HorovodRetryPolicy().for_task(timedelta(seconds=2))
    for error in (lost, slots):  # None: Airflow's own delay, the task's retry_delay (and its backoff)
        decision = task_own.evaluate(error, try_number=1, max_tries=3)
        assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, None)
        assert decision.reason.startswith("Retried after the task's retry_delay (2 s) if retries are left")
    given = HorovodRetryPolicy(lost_delay=7).for_task(timedelta(seconds=2))
    assert given.evaluate(lost, 1, 3).retry_delay == timedelta(seconds=7)
    assert given.evaluate(slots, 1, 3).retry_delay is None
    assert HorovodRetryPolicy(lost_delay=0).evaluate(lost, 1, 3).retry_delay == timedelta(0)  # 0 is a delay too
    assert HorovodRetryPolicy.deserialize(json.loads(json.dumps(given.serialize()))) == given


def test_a_stall_with_an_unresponsive_rank_is_retried_and_one_stuck_in_user_code_fails_at_once():
    from airflow_provider_horovod.exceptions import StallError

    stopped = _run_error(Failure("stalled: rank 1 is stopped (SIGSTOP, a debugger or job control); silent for 5.0 s",
                                 rank=1, host="hvdhost1", stall="unresponsive", lost=True, error_class="StallError"))
    assert isinstance(stopped, StallError) and stopped.unresponsive
    decision = HorovodRetryPolicy(lost_delay=12).evaluate(stopped, try_number=1, max_tries=3)
    assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, timedelta(seconds=12))
    assert "(lost infrastructure): rank 1 on hvdhost1 did not answer in a stall" in decision.reason
    stuck = _run_error(Failure("stalled: rank 1 in user code at train (job.py:12)", rank=1, stall="stuck",
                               error_class="StallError"))
    assert not stuck.unresponsive
    decision = HorovodRetryPolicy().evaluate(stuck, try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    assert "Not retried (user code): rank 1 was stuck in the training function's code" in decision.reason


def test_spark_losing_an_executor_is_retried():
    error = HorovodRunError("The Spark job running the Horovod ranks failed:\n  ExecutorLostFailure (executor 1 exited)")
    assert judge(error).cause == Cause.LOST


@pytest.mark.parametrize("error", [
    _run_error(Failure("Rank 0 failed", rank=0, exception="HorovodInternalError: Horovod has been shut down")),
    _run_error(Failure("Rank 0 failed", rank=0, exit="was killed by SIGTERM", consequence=True)),
    _run_error(Failure("stalled: rank 1 never submitted allreduce.x (waited 60 s)", rank=0,
                       exception="HorovodInternalError: stalled")),
    RunCancelledError("The Horovod job was cancelled"),
    HorovodRunError("mpirun exited with code 1"),
    TimeoutError("execution_timeout"),
])
def test_what_the_policy_cannot_tell_is_left_to_airflows_default(error):
    assert HorovodRetryPolicy().evaluate(error, try_number=1, max_tries=3).action == RetryAction.DEFAULT


def test_the_fallback_policy_decides_what_the_horovod_policy_leaves_to_airflow():
    fallback = ExceptionRetryPolicy(rules=[RetryRule(exception=TimeoutError, action=RetryAction.FAIL, reason="no")])
    policy = HorovodRetryPolicy(fallback=fallback)
    assert policy.evaluate(TimeoutError("x"), 1, 3).action == RetryAction.FAIL
    assert policy.evaluate(_run_error(RAISED), 1, 3).reason.startswith("Not retried (user code)")  # first


def test_the_policy_serializes_to_json_and_back_with_its_fallback():
    fallback = ExceptionRetryPolicy(rules=[RetryRule(exception=TimeoutError, action=RetryAction.FAIL)])
    policy = HorovodRetryPolicy(slots_delay=60, lost_delay=timedelta(seconds=5), fallback=fallback)
    data = json.loads(json.dumps(policy.serialize()))
    again = HorovodRetryPolicy.deserialize(data)
    assert again == policy and again.slots_delay == timedelta(seconds=60)
    assert again.fallback.evaluate(TimeoutError(), 1, 2).action == RetryAction.FAIL
    assert HorovodRetryPolicy.deserialize(HorovodRetryPolicy().serialize()) == HorovodRetryPolicy()


@pytest.mark.parametrize("kwargs", [{"slots_delay": -1}, {"lost_delay": "soon"}, {"fallback": "retry"},
                                    {"fallback": ExceptionRetryPolicy}])
def test_bad_policy_arguments_are_refused(kwargs):
    with pytest.raises((ValueError, TypeError)):
        HorovodRetryPolicy(**kwargs)


def test_the_operator_and_the_decorator_use_the_policy_unless_the_task_gives_one():
    from airflow.sdk import DAG, task

    from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

    own = ExceptionRetryPolicy(rules=[])
    with DAG("retry_policies", schedule=None):
        default = HorovodRunnerOperator(task_id="default", training_callable="m:f")
        blind = HorovodRunnerOperator(task_id="blind", training_callable="m:f", retry_policy=None)
        mine = HorovodRunnerOperator(task_id="mine", training_callable="m:f", retry_policy=own)

        @task.horovod(np=2)
        def decorated():
            return 1

        decorated_op = decorated().operator
    assert isinstance(default.retry_policy, HorovodRetryPolicy) and isinstance(decorated_op.retry_policy, HorovodRetryPolicy)
    assert blind.retry_policy is None and mine.retry_policy is own
    with DAG("retry_policies_defaults", schedule=None, default_args={"retry_policy": own}):
        from_defaults = HorovodRunnerOperator(task_id="t", training_callable="m:f")
    assert from_defaults.retry_policy is own


@pytest.mark.parametrize("policy", [HorovodRetryPolicy, ExceptionRetryPolicy, "horovod", lambda e: None])
def test_a_retry_policy_that_is_not_an_instance_is_refused_when_the_dag_is_parsed(policy):
    from airflow.sdk import DAG

    from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

    with DAG("bad_retry_policy", schedule=None), pytest.raises(TypeError) as info:
        HorovodRunnerOperator(task_id="t", training_callable="m:f", retry_policy=policy)
    if isinstance(policy, type):
        assert "retry_policy=%s is a class; give an instance: retry_policy=%s()" % (policy.__name__, policy.__name__) \
            in str(info.value)
    else:
        assert "retry_policy must be an Airflow RetryPolicy instance" in str(info.value)
    with DAG("bad_retry_policy_defaults", schedule=None, default_args={"retry_policy": HorovodRetryPolicy}), \
            pytest.raises(TypeError, match="is a class"):
        HorovodRunnerOperator(task_id="t", training_callable="m:f")


def test_a_task_that_sets_retry_delay_keeps_it_under_the_default_policy():
    from airflow.sdk import DAG, task

    from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

    with DAG("retry_delays", schedule=None):
        own = HorovodRunnerOperator(task_id="own", training_callable="m:f", retry_delay=timedelta(seconds=2))
        airflows_default = HorovodRunnerOperator(task_id="airflows_default", training_callable="m:f")
        given = HorovodRunnerOperator(task_id="given", training_callable="m:f", retry_delay=timedelta(seconds=2),
                                      retry_policy=HorovodRetryPolicy(lost_delay=9))

        @task.horovod(np=2, retry_delay=3)
        def decorated():
            return 1

        decorated_op = decorated().operator
    with DAG("retry_delays_defaults", schedule=None, default_args={"retry_delay": timedelta(seconds=4)}):
        from_defaults = HorovodRunnerOperator(task_id="t", training_callable="m:f")
    assert own.retry_policy.task_retry_delay == timedelta(seconds=2) and own.retry_policy.delay_for(Cause.LOST) is None
    assert airflows_default.retry_policy == HorovodRetryPolicy()
    assert airflows_default.retry_policy.delay_for(Cause.LOST) == timedelta(seconds=30)
    assert given.retry_policy.delay_for(Cause.LOST) == timedelta(seconds=9)
    assert given.retry_policy.delay_for(Cause.SLOTS) is None
    assert decorated_op.retry_policy.task_retry_delay == timedelta(seconds=3)
    assert from_defaults.retry_policy.task_retry_delay == timedelta(seconds=4)
