"""Typed records of a run: failure reports, the events the supervisor consumes, the run report."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_horovod.exceptions import (
    ArtifactError,
    DatasetError,
    Keras3NotSupportedError,
    PayloadError,
    TorchStoreError,
    WrongLauncherError,
)
from airflow_provider_horovod.runner.launchers import Launcher

if TYPE_CHECKING:  # the operator and the store read run reports without importing Horovod
    from airflow_provider_horovod.runner.plan import TaskFacts


# The provider's exceptions a rank raises (runtime, payload, Keras and Horovod guards, dataset shard, torch store): the only
# ``error_class`` a rank's report may name. The others decide retries and restarts (InsufficientSlotsError
# is retried, StallError is the driver's): a rank claiming one is a plain failure of its own.
RANK_ERROR_CLASSES = frozenset(c.__name__ for c in (PayloadError, Keras3NotSupportedError, DatasetError, ArtifactError,
                                                   WrongLauncherError, TorchStoreError))


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a rank or a task failed. Travels as JSON (channel, result rows, error files)."""

    message: str  # one line a user reads first
    rank: int | None = None
    host: str | None = None
    executor: str | None = None
    exception: str | None = None  # "ValueError: boom", when Python raised
    error_class: str | None = None  # the provider exception raised ("Keras3NotSupportedError"), if one
    exit: str | None = None  # "exited with code 3", "was killed by SIGKILL"
    traceback: str = ""
    tail: tuple[str, ...] = ()  # the rank's last lines of output
    launcher_output: tuple[str, ...] = ()  # mpirun's own words, after the rank's
    consequence: bool = False  # a rank ended because the job was being stopped
    lost: bool = False  # the driver lost the task: its Python worker, executor or host is gone (restarts)
    stall: str | None = None  # a stall (driver/stalls.py): "unresponsive" (restarts, retries) or "stuck" (a bug)
    time: float = dataclasses.field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tail"] = list(self.tail)
        out["launcher_output"] = list(self.launcher_output)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Failure:
        """A report as it came (from a rank, a task, a file): every field of its own type, whatever
        was sent, so a malformed report cannot break the verdict that reads it."""
        def text(key: str) -> str | None:
            value = raw.get(key)
            return None if value is None else str(value)

        def lines(key: str) -> tuple[str, ...]:
            value = raw.get(key) or ()
            return tuple(str(line) for line in value) if isinstance(value, (list, tuple)) else (str(value),)

        rank, when = raw.get("rank"), raw.get("time")
        return cls(message=text("message") or text("exception") or "failed",
                   rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                   host=text("host"), executor=text("executor"), exception=text("exception"), exit=text("exit"),
                   traceback=text("traceback") or "", tail=lines("tail"), launcher_output=lines("launcher_output"),
                   consequence=raw.get("consequence") is True, lost=raw.get("lost") is True,
                   error_class=text("error_class"), stall=text("stall"),
                   time=when if isinstance(when, float) else time.time())

    @property
    def secondary(self) -> bool:
        """This failure follows from another: the rank was stopped by the runner, or Horovod shut
        down under it because a peer went away (Horovod's own words for that)."""
        return self.consequence or (self.exception or "").startswith("HorovodInternalError")

    def told_by_rank(self, rank: int, *, when: float | None = None) -> Failure:
        """What a rank's own report may say (issue 49, T5-3): its exception (text, traceback and the
        provider class it is of, when a rank raises that class: ``RANK_ERROR_CLASSES``) and its last
        lines, as rank ``rank`` (who sent it, from its key or its file). Where it ran, how its process
        ended, a loss, a stall or a stop are facts for the task and the driver, from the plan and the
        operating system (``placed``, the task's ``exit``): never taken from the rank."""
        exception = self.exception or "the rank's report named no exception: %s" % self.message
        return Failure(message="Rank %d failed: %s" % (rank, exception), rank=rank, exception=exception,
                       error_class=self.error_class if self.error_class in RANK_ERROR_CLASSES else None,
                       traceback=self.traceback, tail=self.tail, time=time.time() if when is None else when)

    def placed(self, host: str, executor: str) -> Failure:
        """This rank's failure where the plan put the rank: ``Rank 1 on host h (executor 2) failed: ...``."""
        prefix = "Rank %s failed" % self.rank
        message = self.message
        if message.startswith(prefix):
            message = "Rank %s on host %s (executor %s) failed%s" % (self.rank, host, executor, message[len(prefix):])
        return dataclasses.replace(self, host=host, executor=executor, message=message)

    def with_tail(self, tail: list[str] | tuple[str, ...]) -> Failure:
        return self if self.tail or not tail else dataclasses.replace(self, tail=tuple(tail))


# -- what the supervisor consumes ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TaskStarted:
    partition: int
    executor: str


@dataclasses.dataclass(frozen=True)
class FactsReported:
    facts: TaskFacts


@dataclasses.dataclass(frozen=True)
class TaskReady:
    partition: int


@dataclasses.dataclass(frozen=True)
class RankFailed:
    failure: Failure


@dataclasses.dataclass(frozen=True)
class TaskFinished:
    """A task's ranks ended (rank 0's task has handed over its artifacts by then)."""

    partition: int
    failure: Failure | None = None


@dataclasses.dataclass(frozen=True)
class TaskLost:
    """A task's connection dropped before it finished: its Python worker died."""

    partition: int


@dataclasses.dataclass(frozen=True)
class UploadStarted:
    pass


@dataclasses.dataclass(frozen=True)
class UploadFinished:
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """The Spark job (or the driver's local ranks) returned: rows, or the error it raised."""

    value: Any = None
    error: BaseException | None = None
    failure: Failure | None = None  # a task's own report inside ``error`` (it could not use the channel)


@dataclasses.dataclass(frozen=True)
class CancelRequested:
    pass


@dataclasses.dataclass(frozen=True)
class RankBeat:
    """A rank's pulse (``messages.Beat``): the stall rule's input (``driver/stalls.py``)."""

    rank: int
    pid: int
    host: str
    idle_s: float
    where: str
    stacks: str | None = None
    done: bool = False


@dataclasses.dataclass(frozen=True)
class RanksInspected:
    """What a task saw of its ranks' processes before it stopped them (``messages.RankStates``)."""

    states: Mapping[int, Mapping[str, Any]]


Event = (TaskStarted | FactsReported | TaskReady | RankFailed | TaskFinished | TaskLost | UploadStarted
         | UploadFinished | JobEnded | CancelRequested | RankBeat | RanksInspected)


# -- what a run leaves behind --------------------------------------------------------------------
class RunStatus(enum.StrEnum):
    """How far a run got, and how it ended (``RunReport.status``). A ``str``: JSON holds the word."""

    NOT_STARTED = "not started"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Ending(enum.StrEnum):
    """How one attempt ended (``AttemptRecord.ending``; the restart policy's input, ``driver/restarts.py``)."""

    SUCCESS = "success"
    LOST = "lost"  # lost infrastructure: the only ending that restarts
    FAILED = "failed"  # the training function, its payload, environment or dataset: never restarts
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a run, as the task log, ``last_run.attempts``, the XCom and the view show it
    (the last three as ``to_json()``: the XCom, the try's marker and MLflow's tags hold that dict)."""

    number: int  # 0, 1, ...: ``runtime.attempt()`` inside its ranks
    np: int
    started_s: float  # seconds since run() began
    resumed_from: dict[str, Any] | None = None  # {"seq", "step"} of the driver's version, or {"path"}
    restart_s: float | None = None  # from the loss that ended the attempt before to this one's ranks starting
    ending: Ending | None = None
    cause: str | None = None  # the one line that says why it ended (None: it succeeded)
    duration_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ending"] = None if self.ending is None else self.ending.value
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> AttemptRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in raw.items() if k in fields}
        if known.get("ending") is not None:
            known["ending"] = Ending(known["ending"])
        return cls(**known)

    def describe(self) -> str:
        """``attempt 1 (2 ranks, resumed from version 3, step 7): lost: The barrier task ... died``."""
        what = "%d rank%s" % (abs(self.np), "" if abs(self.np) == 1 else "s")
        if self.resumed_from:
            what += ", resumed from %s" % resumed_text(self.resumed_from)
        return "attempt %d (%s): %s%s" % (self.number, what, self.ending or "running",
                                          ": %s" % self.cause if self.cause else "")


def resumed_text(resumed_from: Mapping[str, Any]) -> str:
    if "seq" in resumed_from:
        return "version %s (step %s)" % (resumed_from["seq"], resumed_from.get("step"))
    return str(resumed_from.get("path"))


@dataclasses.dataclass(eq=False)
class RunReport:
    """``HorovodRunner.last_run``: how the newest run went, one field each."""

    run_id: str
    np: int
    launcher: Launcher
    status: RunStatus = RunStatus.RUNNING
    result: Any = None
    duration_s: float | None = None
    coordination: str | None = None  # "channel" (the driver's channel), "spark" (allGather), "local"
    artifact_dir: str | None = None
    artifacts: dict[str, Any] | None = None  # the committed marker
    timeline_path: str | None = None
    timeline_summary_path: str | None = None
    timeline_picture_path: str | None = None
    checkpoint_path: str | None = None  # the newest complete checkpoint: checkpoints/ at the end, else a version
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # versions committed during the run
    checkpoint_errors: list[str] = dataclasses.field(default_factory=list)  # versions the store did not take
    artifact_transport: str | None = None  # "copy" (same host), "stream", or None
    artifact_transfer_s: float | None = None
    artifact_bytes: int = 0
    error: dict[str, Any] | None = None  # the failure report, as JSON
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds since run() began
    attempts: list[AttemptRecord] = dataclasses.field(default_factory=list)  # one per stage
    rejected_connections: int = 0

    def attempts_json(self) -> list[dict[str, Any]]:
        """``attempts`` as the XCom, the try's marker and MLflow's tags hold them."""
        return [attempt.to_json() for attempt in self.attempts]
