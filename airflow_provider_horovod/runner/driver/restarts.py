"""The restart policy: how an attempt ended, and whether the run starts another one.

Pure functions of what the supervisor decided (no clock, no Spark), as Ray Train's
``failure_handling/default.py`` decides RESTART or RAISE: an attempt ended by lost infrastructure
(a barrier task lost, an executor or host gone, a rank killed by a signal from outside) restarts
within ``max_restarts``, from the newest committed version; anything else ends the run as it ended.
"""

from __future__ import annotations

import dataclasses
import re
import signal

from airflow_provider_horovod.runner.events import AttemptRecord, Ending, Failure
from airflow_provider_horovod.runner.options import DEFAULT_LAST_CALL_S


# Signals a process receives from outside: the kernel's OOM killer, a node drain, a preemption, a
# lost terminal. A crash of the process's own (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) is a bug:
# it would crash again.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
_KILLED_BY = re.compile(r"\bkilled by (SIG[A-Z0-9]+)\b")
# Spark's own words for a task whose executor went away (a job failure no task explained)
_SPARK_LOST = re.compile(r"ExecutorLostFailure|Executor heartbeat timed out|worker lost|Remote RPC client disassociated",
                         re.IGNORECASE)


def killed_from_outside(failure: Failure) -> bool:
    """The rank (or its daemon) was killed by a signal it did not raise itself."""
    found = _KILLED_BY.search(failure.exit or "")
    return found is not None and found.group(1) in {s.name for s in EXTERNAL_SIGNALS}


def is_lost(failure: Failure) -> bool:
    """``failure`` is lost infrastructure: a task the channel lost (its worker, executor or host
    gone), or a process killed from outside."""
    return failure.lost or killed_from_outside(failure)


def ending_of(*, cancelled: bool, reason: str | None, cause: Failure | None, job_error: BaseException | None) -> Ending:
    """How an attempt that did not succeed ended: ``cause`` is the supervisor's (the first failure
    that does not follow from another); without one, Spark's own error of the job decides."""
    if cancelled or reason == "cancel":
        return Ending.CANCELLED
    if cause is not None:
        return Ending.LOST if is_lost(cause) else Ending.FAILED
    if reason is None and job_error is not None and _SPARK_LOST.search(str(job_error)):
        return Ending.LOST
    return Ending.FAILED


@dataclasses.dataclass(frozen=True)
class RestartSize:
    """What a restart does with the slots there are now: start ``np`` ranks (``np`` set), fail
    (``fail``), or neither: wait and ask again. ``why`` says it in the log's words."""

    np: int | None = None
    fail: bool = False
    why: str = ""


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts``: how many attempts may follow one that lost infrastructure; ``min_np``: the
    fewest barrier tasks a restart runs on when fewer than ``np`` slots come back (``np`` by default);
    ``last_call_s``: how long a restart that has ``min_np`` slots waits for the rest."""

    max_restarts: int = 0
    min_np: int | None = None
    last_call_s: float = DEFAULT_LAST_CALL_S

    def restarts(self, ending: Ending, restarts_done: int) -> bool:
        return ending == Ending.LOST and restarts_done < self.max_restarts

    def restart_size(self, np: int, slots: int | None, *, waited_s: float, minimum_for_s: float | None,
                     can_grow: bool, start_timeout_s: float) -> RestartSize:
        """The size of the next attempt, asked again while it waits (torchrun's elastic rendezvous):

        * ``np`` slots, or a session that cannot count them (``slots`` is ``None``): ``np``, now;
        * at least ``min_np`` (there for ``minimum_for_s``): what there is, once the rest cannot come
          (``can_grow`` false: a ``local[N]`` master), the last call is over, or ``start_timeout`` is;
        * fewer: fail once the rest cannot come or ``start_timeout`` is over.
        """
        if slots is None or slots >= np:
            return RestartSize(np=np, why="%s barrier slots" % ("np=%d" % np if slots is not None else "unknown"))
        minimum = self.min_np or np
        if slots >= minimum:
            if not can_grow:
                return RestartSize(np=slots, why="the cluster cannot gain slots")
            if minimum_for_s is not None and minimum_for_s >= self.last_call_s:
                return RestartSize(np=slots, why="no more came within last_call=%gs" % self.last_call_s)
            if waited_s >= start_timeout_s:
                return RestartSize(np=slots, why="no more came within start_timeout=%gs" % start_timeout_s)
            return RestartSize()
        if not can_grow:
            return RestartSize(fail=True, why="the cluster cannot gain slots")
        if waited_s >= start_timeout_s:
            return RestartSize(fail=True, why="no more came within start_timeout=%gs" % start_timeout_s)
        return RestartSize()


def attempts_text(records: list[AttemptRecord], max_restarts: int) -> str:
    """What the error of a run with restarts ends with: every attempt and why it ended."""
    lines = ["The run made %d attempt%s (max_restarts=%d):" % (len(records), "" if len(records) == 1 else "s",
                                                               max_restarts)]
    lines += ["  %s" % record.describe() for record in records]
    return "\n".join(lines)
