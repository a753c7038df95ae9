"""The supervisor: every decision the driver takes during a run, and every deadline, in one place.

It consumes typed events (``events.py``) and answers with actions for the runner to carry out; it
never sleeps, reads a clock or touches a socket itself, so each decision can be tested alone with
a list of events and made-up times.

The life of a coordinated run (tasks reach the driver's channel)::

    starting   tasks report their facts; when all ``np`` have, the plan goes to every task
    preparing  tasks fetch resume_from / start the rendezvous; when all are ready: start
    running    ranks train; each task reports when its ranks ended (rank 0's artifacts first)
    stopping   after a failure, a cancel or a slow start: tasks were told to stop their ranks
    ended      every task finished and was released, or the job ended, or it was cut off (a job
               that failed with nothing to say why ends once the channel names the task it lost,
               or after ``lost_task_grace_s``: Spark and the channel see a lost machine in either order)

A run without the channel (``coordinated=False``: Spark's ``allGather`` fallback, or ``np < 0``)
skips the first two phases and ends when its job ends.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from airflow_provider_horovod.runner import procs
from airflow_provider_horovod.runner.events import (
    CancelRequested,
    Event,
    Failure,
    FactsReported,
    JobEnded,
    RankBeat,
    RankFailed,
    RanksInspected,
    TaskFinished,
    TaskLost,
    TaskReady,
    TaskStarted,
    UploadFinished,
    UploadStarted,
)
from airflow_provider_horovod.runner.options import DEFAULT_START_TIMEOUT_S
from airflow_provider_horovod.runner.driver.stalls import StallWatch, silence_for
from airflow_provider_horovod.runner.plan import Plan, TaskFacts
from airflow_provider_horovod.runner.horovod_stall import beat_interval


class Phase(enum.StrEnum):
    """Where the run is: tasks report and wait for the plan, prepare, run their ranks, are stopped, ended."""

    STARTING = "starting"
    PREPARING = "preparing"
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"


class Upload(enum.StrEnum):
    """Rank 0's hand-over of its artifacts to the driver."""

    NONE = "none"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """Every timeout of the driver, with the relationships between them checked."""

    start_s: float = DEFAULT_START_TIMEOUT_S  # all barrier tasks started and reported (the user's start_timeout)
    stop_grace_s: float = 20.0  # after a stop request (failure, slow start): tasks end their ranks
    cancel_grace_s: float = 5.0  # the same after a user's cancel
    artifact_grace_s: float = 60.0  # after a failure, how long an upload in flight may still run
    cancel_artifact_grace_s: float = 3.0  # the same after a cancel
    cut_off_join_s: float = 30.0  # after cutting the job off, how long to wait for Spark to return
    cancel_bound_s: float = 10.0  # a cancelled run leaves no process after this long (a promise)
    lost_task_grace_s: float = 3.0  # Spark failed the job first: how long the channel may still name the task lost
    preempt_grace_s: float = 10.0  # after a preemption notice (decommission, SIGTERM), how long a restart waits for rank 0's version; a task told to terminate lives as long
    stall_s: float = 600.0  # no rank made progress for this long: a stall (the user's stall_timeout, stalls.py)

    def __post_init__(self) -> None:
        if self.start_s <= 0:
            raise ValueError("start_timeout must be positive; got %r" % (self.start_s,))
        # A cancel: grace, then the upload's extra, then the reapers' TERM->KILL grace must all fit.
        kill_s = procs.STOP_GRACE_S + procs.WATCH_INTERVAL_S
        assert self.cancel_grace_s + self.cancel_artifact_grace_s + kill_s <= self.cancel_bound_s
        # Ranks notice a dead task within one watchdog interval, well inside the cancel grace.
        assert procs.WATCH_INTERVAL_S < self.cancel_grace_s
        # An upload in flight after a failure is given longer than the stop grace, never less.
        assert self.artifact_grace_s >= self.stop_grace_s


@dataclasses.dataclass(frozen=True)
class SendPlan:
    plan: Plan


@dataclasses.dataclass(frozen=True)
class SendStart:
    pass


@dataclasses.dataclass(frozen=True)
class Release:
    """Every task finished: let them all return (the job then ends by itself)."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Ask every task to end its ranks now (rank 0's task still hands over its artifacts)."""


@dataclasses.dataclass(frozen=True)
class CutOff:
    """Hang up on every task and interrupt the Spark job: whatever still runs ends now."""


Action = SendPlan | SendStart | Release | Stop | CutOff


class Supervisor:
    """Decides, from the events of one run, what the driver does next and when the run is over.

    :param np: the number of barrier tasks (``0`` for a run with no tasks: ``np < 0``).
    :param coordinated: the tasks reach the driver's channel and wait for its plan and start.
    :param planner: facts of every task -> plan; raises ``PlanError`` when they cannot run the job.
    :param now: the time the run started (any monotonic clock, the same as later calls').
    """

    def __init__(self, np: int, *, coordinated: bool, planner: Callable[[list[TaskFacts]], Plan],
                 deadlines: Deadlines, now: float, here: tuple[str, str] | None = None) -> None:
        self.np = np
        self.here = here  # (host, executor) of every rank when the run has no plan of ours (np < 0: the driver)
        self.coordinated = coordinated
        self.deadlines = deadlines
        self._planner = planner
        self._began = now
        self.phase = Phase.STARTING if coordinated else Phase.RUNNING
        self.reason: str | None = None  # why the run was stopped: "error", "cancel" or "timeout"
        self.failures: list[Failure] = []  # every failure reported, in the order they arrived
        self.plan: Plan | None = None
        self.started: set[int] = set()
        self._facts: dict[int, TaskFacts] = {}
        self._ready: set[int] = set()
        self.finished: dict[int, Failure | None] = {}
        self.upload = Upload.NONE
        self.job_ended: JobEnded | None = None
        self._stop_at: float | None = None
        self._cut_at: float | None = None
        self._job_failed_at: float | None = None  # Spark failed the job before the channel said why
        self.marks: dict[str, float] = {}
        self.stalls = StallWatch(deadlines.stall_s, silence_for(beat_interval(deadlines.stall_s)))
        if not coordinated:
            self.stalls.start(now)

    # -- the verdict -----------------------------------------------------------------------------
    @property
    def began(self) -> float:
        """The time the run started (the clock of every call's ``now``; ``marks`` count from it)."""
        return self._began

    @property
    def done(self) -> bool:
        return self.phase == Phase.ENDED

    @property
    def cause(self) -> Failure | None:
        """The failure to show the user: the first that does not follow from another (a rank that
        raised or died, rather than the peer whose collective broke because of it)."""
        primary = [f for f in self.failures if not f.secondary]
        return (primary or self.failures or [None])[0]

    @property
    def released(self) -> bool:
        return "released" in self.marks

    # -- events ----------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        if self._job_failed_at is not None:
            return self._after_job_failed(event)
        if isinstance(event, TaskStarted):
            self.started.add(event.partition)
            return []
        if isinstance(event, FactsReported):
            return self._on_facts(event.facts, now)
        if isinstance(event, TaskReady):
            self._ready.add(event.partition)
            if self.phase == Phase.PREPARING and len(self._ready) == self.np:
                self.phase = Phase.RUNNING
                self._mark("start", now)
                self.stalls.start(now, len(self.plan.slots) if self.plan is not None else 0)
                return [SendStart()]
            return []
        if isinstance(event, RankFailed):
            return self._on_failure(self._placed(event.failure), now)
        if isinstance(event, TaskLost):
            if event.partition in self.finished:
                return []
            return self._on_failure(self._lost(event.partition), now)
        if isinstance(event, TaskFinished):
            return self._on_finished(event, now)
        if isinstance(event, UploadStarted):
            self.upload = Upload.RUNNING
            return []
        if isinstance(event, UploadFinished):
            self.upload = Upload.FAILED if event.error else Upload.DONE
            return []
        if isinstance(event, JobEnded):
            if event.failure is not None:
                # A task that could not use the channel said why in the stage's error: that comes
                # first, before the loss of the tasks Spark aborted because of it.
                self.failures.insert(0, event.failure)
            self.job_ended = event
            self._mark("job-ended", now)
            if self._unexplained(event):
                self._job_failed_at = now  # a lost machine reaches Spark and the channel in either order
                return []
            self.phase = Phase.ENDED
            return []
        if isinstance(event, CancelRequested):
            return self._stop("cancel", now)
        if isinstance(event, RankBeat):
            self.stalls.beat(event, now)
            return []
        if isinstance(event, RanksInspected):
            self.stalls.inspected(event.states)
            return []
        raise TypeError("not an event: %r" % (event,))

    def _unexplained(self, event: JobEnded) -> bool:
        """The job failed while tasks ran and nothing says why yet (no task's failure, no stop):
        Spark saw a task's executor or machine go before the channel saw the task's connection drop."""
        return event.error is not None and self.coordinated and self.reason is None and \
            not any(not f.secondary for f in self.failures) and bool(self.started - set(self.finished))

    def _after_job_failed(self, event: Event) -> list[Action]:
        """Within ``lost_task_grace_s`` of an unexplained job failure: the task lost or the rank
        failure that explains it ends the run (the job is over, so nothing is sent to the tasks)."""
        if isinstance(event, TaskLost) and event.partition not in self.finished:
            self.failures.append(self._lost(event.partition))
        elif isinstance(event, (RankFailed, TaskFinished)) and event.failure is not None:
            self.failures.append(self._placed(event.failure))
        if any(not f.secondary for f in self.failures):
            self.phase = Phase.ENDED
        return []

    def _on_facts(self, facts: TaskFacts, now: float) -> list[Action]:
        if self.phase != Phase.STARTING:
            return [Stop()] if self.reason else []  # a late or resubmitted task: nothing to do here
        self._facts[facts.partition] = facts
        if len(self._facts) < self.np:
            return []
        self._mark("facts", now)
        try:
            self.plan = self._planner([self._facts[p] for p in sorted(self._facts)])
        except PlanError as err:
            return self._on_failure(err.failure, now)
        self.phase = Phase.PREPARING
        return [SendPlan(self.plan)]

    def _lost(self, partition: int) -> Failure:
        """A task's connection dropped before it finished: its Python worker, its executor or its
        whole machine is gone. Says which host, from the plan (or the task's facts before it)."""
        slot = self.plan.for_partition(partition) if self.plan is not None else None
        facts = self._facts.get(partition)
        executor = slot.executor if slot is not None else (facts.executor if facts is not None else None)
        host = slot.hostname if slot is not None else None
        where = "" if executor is None else " on %s(executor %s)" % ("host %s " % host if host else "", executor)
        return Failure("The barrier task of partition %d%s died: its Python worker, its executor or that machine "
                       "is gone." % (partition, where), host=host, executor=executor, lost=True)

    def _placed(self, failure: Failure) -> Failure:
        """A rank's failure with the host and executor the plan gave that rank: a rank's report says
        nothing of where it ran (``Failure.told_by_rank``), and a stall's names the host the rank's
        beats gave (issue 49)."""
        if failure.rank is None:
            return failure
        if self.plan is None:  # np < 0: every rank runs on the driver, whichever way its report came
            return failure if self.here is None else failure.placed(*self.here)
        slot = next((s for s in self.plan.slots if s.rank == failure.rank), None)
        return failure if slot is None else failure.placed(slot.hostname, slot.executor)

    def _on_failure(self, failure: Failure, now: float) -> list[Action]:
        self.failures.append(failure)
        return self._stop("error", now)

    def _on_finished(self, event: TaskFinished, now: float) -> list[Action]:
        self.finished[event.partition] = event.failure
        actions: list[Action] = []
        if event.failure is not None:
            actions += self._on_failure(event.failure, now)
        if len(self.finished) == self.np and not self.released:
            self._mark("released", now)
            actions.append(Release())
        return actions

    def _stop(self, reason: str, now: float) -> list[Action]:
        if self.phase == Phase.ENDED:
            return []
        if self.reason is not None:
            if reason == "cancel" and self.reason != "cancel":
                self.reason = "cancel"  # a cancel shortens whatever grace is running
            return []
        self.reason = reason
        self.phase = Phase.STOPPING
        self._stop_at = now
        self._mark("stop", now)
        return [Stop()]

    # -- time ------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Action]:
        """What the passing of time decides: a slow start, a stop that took too long."""
        if self._job_failed_at is not None:
            if now - self._job_failed_at >= self.deadlines.lost_task_grace_s:
                self.phase = Phase.ENDED  # no task said why: the job's own error is all there is
            return []
        if self.phase in (Phase.STARTING, Phase.PREPARING) and now - self._began > self.deadlines.start_s \
                and len(self._facts) < self.np:
            return self._stop("timeout", now)
        if self.phase == Phase.RUNNING and self.stalls.due(now):
            # its stacks came with the beats: now stop, naming the plan's host
            return self._on_failure(self._placed(self.stalls.verdict(now)), now)
        if self.phase == Phase.STOPPING and self._cut_at is None and self._stop_at is not None:
            if now >= self._cut_off_time():
                self._cut_at = now
                self._mark("cut-off", now)
                return [CutOff()]
        if self._cut_at is not None and now - self._cut_at > self.deadlines.cut_off_join_s:
            self.phase = Phase.ENDED  # Spark never returned after the cut-off: give up on it
        return []

    def _cut_off_time(self) -> float:
        assert self._stop_at is not None
        d = self.deadlines
        if self.reason == "cancel":
            grace = d.cancel_grace_s + (d.cancel_artifact_grace_s if self.upload == Upload.RUNNING else 0.0)
        else:
            grace = d.artifact_grace_s if self.upload == Upload.RUNNING else d.stop_grace_s
        return self._stop_at + grace

    def next_wakeup(self, now: float) -> float:
        """Seconds until the next deadline that ``tick`` must see (bounded, so a lost event costs little)."""
        candidates = [1.0]
        if self.phase in (Phase.STARTING, Phase.PREPARING):
            candidates.append(self._began + self.deadlines.start_s - now)
        if self.phase == Phase.STOPPING and self._cut_at is None:
            candidates.append(self._cut_off_time() - now)
        if self.phase == Phase.RUNNING:
            candidates.append(self.stalls.due_in(now))
        if self._job_failed_at is not None:
            candidates.append(self._job_failed_at + self.deadlines.lost_task_grace_s - now)
        return max(0.01, min(candidates))

    def _mark(self, name: str, now: float) -> None:
        self.marks.setdefault(name, now - self._began)


class PlanError(Exception):
    """The tasks' facts say the job cannot run (another Python, no mpirun, ...)."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(failure.message)

