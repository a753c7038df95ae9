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
``ClusterSettingsError``, ``Keras3NotSupportedError``,
``ArtifactSettingsError`` (a malformed artifact root,
a missing file system or connection, a ``run_id``
of ``..``)
``FixedSlotsError`` (too few slots on a ``local[N]``   fail now: no executor can join a local
master)                                                master, the next try finds the same slots
``InsufficientSlotsError`` (too few slots)             retry after ``slots_delay`` (5 min)
a lost host, executor or task; a rank killed by a      retry after ``lost_delay`` (30 s), resumed
signal from outside (``SIGKILL``: the OOM killer;      from the newest committed checkpoint
``SIGTERM``: a preemption; ``SIGHUP``, ``SIGINT``); a
stall whose stalled rank did not answer
(``StallError``, ``unresponsive``: stopped, gone)
a rank killed by a signal of its own (``SIGABRT``:     fail now: a crash, the next try crashes
``os.abort()``, a failed native assert; ``SIGSEGV``,   again (the restart table's rule)
``SIGBUS``, ``SIGFPE``, ``SIGILL``)
a stall with a rank stuck in the user's code           fail now: a bug, the next try stalls again
anything else (a cancel, a timeout, ...)               Airflow's default (``retries``,
                                                       ``retry_delay``), or ``fallback``'s decision
=====================================================  ==========================================

Every decision is bounded by the task's ``retries``: a policy can fail a task early, never retry it
more. The delays only replace Airflow's default: a task that sets ``retry_delay`` itself (as an
argument or in ``default_args``) is retried after its own delay (and its
``retry_exponential_backoff``), unless the policy was given ``slots_delay`` or ``lost_delay``
explicitly. The decision's reason is in the task log (Airflow's ``Retry policy decision`` line, and the
operator's own line before it) and, for a try that stored its artifacts, in the Horovod view.

.. seealso:: ``docs/how-to.md`` ("Retries")
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.definitions.retry_policy import RetryAction, RetryDecision, RetryPolicy

from airflow_provider_horovod.exceptions import (
    ArtifactSettingsError,
    ClusterSettingsError,
    DatasetError,
    ExecutorMismatchError,
    FixedSlotsError,
    HorovodRunError,
    InsufficientSlotsError,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
    TrainingStackError,
)
from airflow_provider_horovod.runner.driver.restarts import killed_from_outside
from airflow_provider_horovod.runner.events import Failure
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
    (FixedSlotsError, "the cluster's barrier slots cannot grow"),
    (ArtifactSettingsError, "the artifact root or the run's ids cannot be used as given"),
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
            return "Retried after %s if retries are left (%s): %s" % (
                (policy or HorovodRetryPolicy()).describe_delay(self.cause), self.cause, self.reason)
        return "Airflow's retry rules apply (%s): %s" % (self.cause, self.reason)


def judge(error: BaseException, failure: dict[str, Any] | None = None) -> Verdict:
    """The cause of a failed try, from its exception and, when it has one, the engine's failure
    report (``events.Failure`` as JSON: ``HorovodRunError.failure``). A pure function."""
    failure = failure if failure is not None else getattr(error, "failure", None)
    if isinstance(error, RunCancelledError):
        return Verdict(Cause.OTHER, "the run was cancelled")
    for cls, why in _NEVER_FIXED:
        if isinstance(error, cls):
            return Verdict(Cause.NEVER_FIXED, "%s (%s: %s)" % (why, cls.__name__, _first_line(error)))
    if isinstance(error, InsufficientSlotsError):
        return Verdict(Cause.SLOTS, _first_line(error))
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
        if killed_from_outside(Failure(message="", exit=exit_text)):
            return Verdict(Cause.LOST, "%s %s (the OOM killer, a preemption or a lost machine)" % (where, one_line(exit_text)))
        return Verdict(Cause.USER_CODE, "%s %s, a signal of its own: a crash (os.abort(), a failed assertion or a fault "
                       "in native code), which the next try would repeat. Fix the code and clear the task"
                       % (where, one_line(exit_text)))
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
    :param task_retry_delay: the task's own ``retry_delay``, when the task set one: it replaces the
        delays this policy was not given (the operator sets it; ``None``: the policy's defaults).
    """

    def __init__(self, *, slots_delay: timedelta | float | None = None, lost_delay: timedelta | float | None = None,
                 fallback: RetryPolicy | None = None, task_retry_delay: timedelta | float | None = None) -> None:
        self.given = {name: _delay(value, name) for name, value in (("slots_delay", slots_delay),
                                                                   ("lost_delay", lost_delay)) if value is not None}
        self.task_retry_delay = None if task_retry_delay is None else _delay(task_retry_delay, "task_retry_delay")
        if fallback is not None and not isinstance(fallback, RetryPolicy):
            raise TypeError("fallback must be an Airflow RetryPolicy instance (or None); got %r" % (fallback,))
        self.fallback = fallback

    @property
    def slots_delay(self) -> timedelta:
        """The delay before a retry after too few slots: the one given, else the task's, else 5 min."""
        return self._effective(Cause.SLOTS)

    @property
    def lost_delay(self) -> timedelta:
        """The delay before a retry after lost infrastructure: the one given, else the task's, else 30 s."""
        return self._effective(Cause.LOST)

    def _effective(self, cause: str) -> timedelta:
        delay = self.delay_for(cause)
        return delay if delay is not None else (self.task_retry_delay or timedelta(0))

    def for_task(self, retry_delay: timedelta | float) -> HorovodRetryPolicy:
        """This policy for a task that set ``retry_delay`` itself: the delays this policy was not given
        are left to the task (its ``retry_delay`` and ``retry_exponential_backoff``)."""
        return type(self)(**{**self.given, "fallback": self.fallback, "task_retry_delay": retry_delay})

    def delay_for(self, cause: str) -> timedelta | None:
        """The delay of a retry for ``cause``; ``None``: the task's own (Airflow computes it, backoff included)."""
        name = "slots_delay" if cause == Cause.SLOTS else "lost_delay"
        if name in self.given:
            return self.given[name]
        if self.task_retry_delay is not None:
            return None
        return DEFAULT_SLOTS_DELAY if cause == Cause.SLOTS else DEFAULT_LOST_DELAY

    def describe_delay(self, cause: str) -> str:
        """``30 s``, or ``the task's retry_delay (2 s)``."""
        delay = self.delay_for(cause)
        if delay is None:
            return "the task's retry_delay (%g s)" % self.task_retry_delay.total_seconds()
        return "%g s" % delay.total_seconds()

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
                               **{name: delay.total_seconds() for name, delay in self.given.items()}}
        if self.task_retry_delay is not None:
            out["task_retry_delay"] = self.task_retry_delay.total_seconds()
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
        return cls(slots_delay=data.get("slots_delay"), lost_delay=data.get("lost_delay"), fallback=fallback,
                   task_retry_delay=data.get("task_retry_delay"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HorovodRetryPolicy) and self.serialize() == other.serialize()

    def __hash__(self) -> int:
        return hash((self.slots_delay, self.lost_delay, self.task_retry_delay))

    def __repr__(self) -> str:
        return "HorovodRetryPolicy(slots_delay=%r, lost_delay=%r, fallback=%r, task_retry_delay=%r)" % (
            self.given.get("slots_delay"), self.given.get("lost_delay"), self.fallback, self.task_retry_delay)


def check_policy(policy: Any) -> None:
    """A task's ``retry_policy``: an Airflow ``RetryPolicy`` instance or ``None``; a class (``retry_policy=
    HorovodRetryPolicy``) or anything else is refused when the DAG is parsed, naming the fix (Airflow itself
    would log "Retry policy evaluation failed" at the first failure and retry it blindly)."""
    if policy is None or isinstance(policy, RetryPolicy):
        return
    if isinstance(policy, type) and issubclass(policy, RetryPolicy):
        raise TypeError("retry_policy=%s is a class; give an instance: retry_policy=%s() (or retry_policy=None for "
                        "Airflow's own rule)." % (policy.__name__, policy.__name__))
    raise TypeError("retry_policy must be an Airflow RetryPolicy instance (HorovodRetryPolicy(), "
                    "ExceptionRetryPolicy(rules=[...])) or None; got %r." % (policy,))


def _delay(value: timedelta | float, name: str) -> timedelta:
    delay = value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        delay = timedelta(seconds=value)
    if not isinstance(delay, timedelta) or delay < timedelta(0):
        raise ValueError("%s must be a timedelta or seconds >= 0; got %r" % (name, value))
    return delay


__all__ = ["Cause", "HorovodRetryPolicy", "Verdict", "check_policy", "judge"]
