"""``HorovodRetryPolicy``: Airflow's retries (AIP-105) that never retry a bug.

A try of a Horovod task costs a Spark start and a barrier stage on every slot; a retry is worth it
only when the next try can end differently. The operator and ``@task.horovod`` use this policy
unless the task gives its own ``retry_policy`` (``retry_policy=None``: Airflow's blind retries):

=====================================================  ==========================================
what ended the try                                     decision
=====================================================  ==========================================
the training function raised (a rank's own exception)  fail now: the next try raises it again
``PayloadError``, ``DatasetError``,                    fail now: a retry ships the same callable,
``TrainingStackError``, ``ExecutorMismatchError``      reads the same data, finds the same
(environment or version mismatch),                     executors and settings
``ClusterSettingsError``, ``Keras3NotSupportedError``
``InsufficientSlotsError`` (too few slots)             retry after ``slots_delay`` (5 min)
a lost host, executor or task; a rank killed by a      retry after ``lost_delay`` (30 s), resumed
signal (the OOM killer, a preemption); a stall whose   from the newest committed checkpoint
stalled rank did not answer (``StallError``,
``unresponsive``: stopped, gone)
a stall with a rank stuck in the user's code           fail now: a bug, the next try stalls again
anything else (a cancel, a timeout, ...)               Airflow's default (``retries``,
                                                       ``retry_delay``), or ``fallback``'s decision
=====================================================  ==========================================

Every decision is bounded by the task's ``retries``: a policy can fail a task early, never retry it
more. The decision's reason is in the task log (Airflow's ``Retry policy decision`` line, and the
operator's own line before it) and, for a try that stored its artifacts, in the Horovod view.

.. seealso:: ``docs/how-to.md`` ("Retries")
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.definitions.retry_policy import RetryAction, RetryDecision, RetryPolicy

from airflow_provider_horovod.exceptions import (
    ClusterSettingsError,
    DatasetError,
    ExecutorMismatchError,
    HorovodRunError,
    InsufficientSlotsError,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
    TrainingStackError,
)
from airflow_provider_horovod.runner.text import one_line

if TYPE_CHECKING:
    from airflow.sdk import Context

DEFAULT_SLOTS_DELAY = timedelta(minutes=5)
DEFAULT_LOST_DELAY = timedelta(seconds=30)

# A rank's exception that says a peer or the network went away, not that the training code is wrong.
_PEER_GONE = ("HorovodInternalError", "DistNetworkError", "DistStoreError", "DistBackendError",
              "torch.distributed.DistNetworkError", "torch.distributed.DistStoreError",
              "torch.distributed.DistBackendError")

# What no retry fixes, by the provider exception that says so.
_NEVER_FIXED: tuple[tuple[type[BaseException], str], ...] = (
    (Keras3NotSupportedError, "Keras 3 objects were given to Horovod's Keras API"),
    (PayloadError, "the training callable or its arguments cannot be shipped"),
    (DatasetError, "the dataset cannot be trained on"),
    (TrainingStackError, "the driver's training stack is incomplete"),
    (ExecutorMismatchError, "an executor's environment differs from the driver's"),
    (ClusterSettingsError, "the Spark settings cannot run a barrier stage"),
)


class Cause:
    """Why a try ended, as the policy sorts it (the words are in the log and the view)."""

    USER_CODE = "user code"
    NEVER_FIXED = "no retry fixes it"
    SLOTS = "too few slots"
    LOST = "lost infrastructure"
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the policy makes of a failure: its cause and the reason a user reads."""

    cause: str
    reason: str

    @property
    def action(self) -> RetryAction:
        if self.cause in (Cause.USER_CODE, Cause.NEVER_FIXED):
            return RetryAction.FAIL
        if self.cause in (Cause.SLOTS, Cause.LOST):
            return RetryAction.RETRY
        return RetryAction.DEFAULT

    def text(self, policy: HorovodRetryPolicy | None = None) -> str:
        """``Not retried: ...``, ``Retried (after 30 s): ...`` or ``Airflow's retry rules apply: ...``."""
        if self.action == RetryAction.FAIL:
            return "Not retried (%s): %s" % (self.cause, self.reason)
        if self.action == RetryAction.RETRY:
            delay = (policy or HorovodRetryPolicy()).delay_for(self.cause)
            return "Retried after %g s if retries are left (%s): %s" % (delay.total_seconds(), self.cause, self.reason)
        return "Airflow's retry rules apply (%s): %s" % (self.cause, self.reason)


def judge(error: BaseException, failure: dict[str, Any] | None = None) -> Verdict:
    """The cause of a failed try, from its exception and, when it has one, the engine's failure
    report (``events.Failure`` as JSON: ``HorovodRunError.failure``). A pure function."""
    failure = failure if failure is not None else getattr(error, "failure", None)
    if isinstance(error, RunCancelledError):
        return Verdict(Cause.OTHER, "the run was cancelled")
    if isinstance(error, InsufficientSlotsError):
        return Verdict(Cause.SLOTS, _first_line(error))
    for cls, why in _NEVER_FIXED:
        if isinstance(error, cls):
            return Verdict(Cause.NEVER_FIXED, "%s (%s: %s)" % (why, cls.__name__, _first_line(error)))
    if not isinstance(error, HorovodRunError):
        return Verdict(Cause.OTHER, "%s: %s" % (type(error).__name__, _first_line(error)))
    return _judge_run(error, failure if isinstance(failure, dict) else {})


def _judge_run(error: HorovodRunError, failure: dict[str, Any]) -> Verdict:
    """A ``HorovodRunError``: who ended the run, from the engine's failure report."""
    exception = str(failure.get("exception") or "")
    rank = failure.get("rank", error.rank)
    where = "rank %s%s" % (rank, " on %s" % failure.get("host") if failure.get("host") else "")
    if failure.get("stall") == "unresponsive":  # the driver's stall rule: a rank that cannot answer
        return Verdict(Cause.LOST, "%s did not answer in a stall (stopped, stuck outside Python or gone): %s"
                       % (where, _first_line(error)))
    if failure.get("stall") == "stuck":
        return Verdict(Cause.USER_CODE, "%s was stuck in the training function's code in a stall; the next try "
                       "would stall again. Fix the code and clear the task: %s" % (where, _first_line(error)))
    if exception and not exception.startswith(_PEER_GONE) and not str(failure.get("message", "")).startswith("stalled:"):
        return Verdict(Cause.USER_CODE, "the training function raised %s in %s; the next try would raise it "
                       "again. Fix the code and clear the task" % (one_line(exception)[:300], where))
    exit_text = str(failure.get("exit") or "")
    if rank is not None and "killed by" in exit_text and not failure.get("consequence"):
        return Verdict(Cause.LOST, "%s %s (the OOM killer, a preemption or a lost machine)" % (where, one_line(exit_text)))
    if rank is None and failure.get("executor") and not exit_text and not exception:
        return Verdict(Cause.LOST, one_line(str(failure.get("message"))))
    if "ExecutorLostFailure" in str(error):  # Spark's own words for a lost executor
        return Verdict(Cause.LOST, "Spark lost an executor of the barrier stage")
    return Verdict(Cause.OTHER, _first_line(error))


def _first_line(error: BaseException) -> str:
    return one_line(str(error).split("\n", 1)[0])[:500]


class HorovodRetryPolicy(RetryPolicy):
    """Retry what a retry fixes, fail at once on what it never fixes, leave the rest to Airflow.

    :param slots_delay: the delay before a try that found too few barrier slots is retried (5
        minutes: the try already waited ``start_timeout`` for them, so the cluster is busy with
        other jobs, which end in minutes, not seconds).
    :param lost_delay: the delay before a try that lost a host, an executor or a rank to a signal
        is retried (30 s: the time a cluster manager takes to replace an executor; the next try
        resumes from the newest committed checkpoint, so waiting costs no training).
    :param fallback: an Airflow retry policy (``ExceptionRetryPolicy``, ...) that decides what this
        policy leaves to Airflow's default; ``None``: Airflow's default.
    """

    def __init__(self, *, slots_delay: timedelta | float = DEFAULT_SLOTS_DELAY,
                 lost_delay: timedelta | float = DEFAULT_LOST_DELAY, fallback: RetryPolicy | None = None) -> None:
        self.slots_delay = _delay(slots_delay, "slots_delay")
        self.lost_delay = _delay(lost_delay, "lost_delay")
        if fallback is not None and not isinstance(fallback, RetryPolicy):
            raise TypeError("fallback must be an Airflow RetryPolicy (or None); got %r" % (fallback,))
        self.fallback = fallback

    def delay_for(self, cause: str) -> timedelta:
        return self.slots_delay if cause == Cause.SLOTS else self.lost_delay

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int,
                 context: Context | None = None) -> RetryDecision:
        verdict = judge(exception)
        if verdict.action == RetryAction.FAIL:
            return RetryDecision.fail(verdict.text(self))
        if verdict.action == RetryAction.RETRY:
            return RetryDecision.retry(self.delay_for(verdict.cause), verdict.text(self))
        if self.fallback is not None:
            return self.fallback.evaluate(exception, try_number, max_tries, context)
        return RetryDecision.default()

    def serialize(self) -> dict[str, Any]:
        out: dict[str, Any] = {"__type": "%s.%s" % (__name__, type(self).__qualname__),
                               "slots_delay": self.slots_delay.total_seconds(),
                               "lost_delay": self.lost_delay.total_seconds()}
        if self.fallback is not None:
            out["fallback"] = self.fallback.serialize()
            out["fallback_type"] = "%s.%s" % (type(self.fallback).__module__, type(self.fallback).__qualname__)
        return out

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> HorovodRetryPolicy:
        fallback = None
        if "fallback" in data:
            from airflow.sdk.module_loading import import_string

            fallback = import_string(data["fallback_type"]).deserialize(data["fallback"])
        return cls(slots_delay=data["slots_delay"], lost_delay=data["lost_delay"], fallback=fallback)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HorovodRetryPolicy) and self.serialize() == other.serialize()

    def __hash__(self) -> int:
        return hash((self.slots_delay, self.lost_delay))

    def __repr__(self) -> str:
        return "HorovodRetryPolicy(slots_delay=%r, lost_delay=%r, fallback=%r)" % (
            self.slots_delay, self.lost_delay, self.fallback)


def _delay(value: timedelta | float, name: str) -> timedelta:
    delay = value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        delay = timedelta(seconds=value)
    if not isinstance(delay, timedelta) or delay < timedelta(0):
        raise ValueError("%s must be a timedelta or seconds >= 0; got %r" % (name, value))
    return delay


__all__ = ["Cause", "HorovodRetryPolicy", "Verdict", "judge"]
