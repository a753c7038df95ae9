"""Every message that crosses the run's authenticated channel, one frozen dataclass each.

Two families, both written here once:

- **Channel messages** carry their type in the frame's ``t`` field. Each class registers itself by
  that type (``@message("facts")``), so adding a message never edits a shared table, and
  ``decode`` turns any frame into its class, or raises ``wire.ProtocolError`` (an unknown type, a
  missing field, a field of the wrong type). Task -> driver: ``Hello``, ``Facts``, ``Ready``,
  ``Finished``, ``PutArtifacts``, ``FetchResume``, ``PutVersion``; rank (or task) -> driver:
  ``Logs``, ``Error``, ``Event``; driver -> task: ``Planned``, ``Start``, ``Stop``, ``Release``.
- **Exec-service messages** go between mpirun's rsh agent and a host's exec service (``rsh.py``,
  ``mpi.py``), on a connection of their own: ``LaunchOrted``, then ``OrtedStarted`` and ``OrtedExited``.
- **Transfer messages** follow ``put``, ``fetch-resume`` or ``put-version`` on that connection
  (both sides of the exchange are in ``transfer.py``: ``offer_tree`` and ``take_tree``); each is
  a frame of one key (``{"mode": ...}``) that the peer expects next, so it carries no ``t``. Their
  decoding is as forgiving as the exchange has always been: what is not understood makes the
  transfer fall back (to a stream, or a refusal); a stream's file header that breaks the rules is
  a ``TransferError``.

Horovod's own driver does the same with its request classes (``horovod.runner.common.service``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.text import one_line
from airflow_provider_horovod.runner.wire import ProtocolError

if TYPE_CHECKING:  # a rank's runtime.log_to_driver sends Logs without importing Horovod (plan.py does)
    from airflow_provider_horovod.runner.plan import Plan, TaskFacts

M = TypeVar("M", bound="Message")
_BY_TYPE: dict[str, type[Message]] = {}


def message(kind: str) -> Callable[[type[M]], type[M]]:
    """Register the decorated class as the channel message of type ``kind`` (the frame's ``t``)."""
    def register(cls: type[M]) -> type[M]:
        if kind in _BY_TYPE:
            raise TypeError("two channel messages of type %r: %s and %s" % (kind, _BY_TYPE[kind].__name__, cls.__name__))
        cls.TYPE = kind
        _BY_TYPE[kind] = cls
        return cls
    return register


def decode(raw: Mapping[str, Any]) -> Message:
    """The channel message ``raw`` is (a frame as ``wire`` received it); ``ProtocolError`` if none."""
    cls = _BY_TYPE.get(raw.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError("a message of unknown type %r" % (raw.get("t"),))
    return cls.from_json(raw)


_UnionType = type(int | None)


def _check(kind: str, name: str, value: Any, hint: Any) -> Any:
    """``value`` if it is of the type ``hint`` names (``X``, ``X | None``, ``list[X]``, ``dict[K, V]``:
    the outer type only; ``object``: anything); a bool is not an int."""
    allowed = tuple(typing.get_origin(h) or h for h in (typing.get_args(hint) if typing.get_origin(hint) in
                                                        (typing.Union, _UnionType) else (hint,)))
    if not isinstance(value, allowed) or (isinstance(value, bool) and int in allowed and bool not in allowed):
        raise ProtocolError("a %s message whose %s is %s, not %s" % (kind, name, type(value).__name__,
                                                                      " or ".join(a.__name__ for a in allowed)))
    return value


def _required(kind: str, raw: Mapping[str, Any], name: str, hint: Any) -> Any:
    if name not in raw:
        raise ProtocolError("a %s message without %s" % (kind, name))
    return _check(kind, name, raw[name], hint)


@dataclasses.dataclass(frozen=True)
class Message:
    """A channel message: its fields are the frame's fields beside ``t``."""

    TYPE: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": self.TYPE, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_json(cls: type[M], raw: Mapping[str, Any]) -> M:
        """The message in ``raw``; ``ProtocolError`` if a field is missing or of another type."""
        hints = typing.get_type_hints(cls)
        values = {}
        for field in dataclasses.fields(cls):
            if field.name in raw or field.default is field.default_factory is dataclasses.MISSING:
                values[field.name] = _required(cls.TYPE, raw, field.name, hints[field.name])
        return cls(**values)


# -- task -> driver: the launch ------------------------------------------------------------------
@message("hello")
@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """First on a barrier task's connection: which partition it is, on which executor."""

    partition: int
    executor: str


@message("facts")
@dataclasses.dataclass(frozen=True)
class Facts(Message):
    """What the driver plans from (``TaskFacts``)."""

    facts: TaskFacts

    def to_json(self) -> dict[str, Any]:
        return {"t": self.TYPE, "facts": self.facts.to_json()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Facts:
        from airflow_provider_horovod.runner.plan import TaskFacts

        try:
            return cls(TaskFacts.from_json(raw["facts"]))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ProtocolError("a facts message whose facts are not a task's: %s" % (err,)) from err


@message("ready")
@dataclasses.dataclass(frozen=True)
class Ready(Message):
    """Prepared: the plan on disk, ``resume_from`` fetched, the rendezvous initialised."""

    partition: int


@message("finished")
@dataclasses.dataclass(frozen=True)
class Finished(Message):
    """The task's ranks ended: with its failure report (or none) and its ranks' last lines."""

    partition: int
    tails: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    failure: Failure | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.TYPE, "partition": self.partition, "tails": self.tails}
        if self.failure is not None:
            out["failure"] = self.failure.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Finished:
        partition = _required(cls.TYPE, raw, "partition", int)
        tails = raw.get("tails") or {}
        if not isinstance(tails, dict) or not all(isinstance(lines, list) for lines in tails.values()):
            raise ProtocolError("a finished message whose tails are not lists of lines by rank")
        failure = raw.get("failure")
        if failure and not isinstance(failure, dict):
            raise ProtocolError("a finished message whose failure is not a report")
        return cls(partition, tails, Failure.from_json(failure) if failure else None)


# -- rank (or task) -> driver ---------------------------------------------------------------------
LOGS_FRAME_BYTES = 512 * 1024  # the most JSON one logs frame of a rank carries (the driver's limit is twice that)
LOG_LINE_CHARS = 32 * 1024  # a longer line of output travels as several (at most 12 bytes of JSON a character)


@message("logs")
@dataclasses.dataclass(frozen=True)
class Logs(Message):
    """Lines of a rank's output. ``callback``: sent by ``runtime.log_to_driver`` (always shown);
    ``quiet``: kept for the failure report only (``driver_log_verbosity="log_callback_only"``)."""

    rank: int
    lines: list[str]
    callback: bool = False
    quiet: bool = False

    @classmethod
    def batches(cls, rank: int, lines: list[str], *, callback: bool = False, quiet: bool = False) -> list[Logs]:
        """``lines`` as frames of at most ``LOGS_FRAME_BYTES`` of JSON each (the driver hangs up on a
        rank's larger frame): a line longer than ``LOG_LINE_CHARS`` travels as several."""
        out: list[Logs] = []
        batch: list[str] = []
        size = 0
        for line in lines:
            for piece in [line[i:i + LOG_LINE_CHARS] for i in range(0, len(line), LOG_LINE_CHARS)] or [line]:
                cost = len(json.dumps(piece)) + 2
                if batch and size + cost > LOGS_FRAME_BYTES:
                    out.append(cls(rank, batch, callback=callback, quiet=quiet))
                    batch, size = [], 0
                batch.append(piece)
                size += cost
        if batch:
            out.append(cls(rank, batch, callback=callback, quiet=quiet))
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Logs:
        if not isinstance(raw.get("lines"), list):
            raise ProtocolError("logs whose lines are not a list")
        return cls(_required(cls.TYPE, raw, "rank", int), [str(line) for line in raw["lines"]],
                   callback=bool(raw.get("callback")), quiet=bool(raw.get("quiet")))


@message("error")
@dataclasses.dataclass(frozen=True)
class Error(Message):
    """A rank's (or a task's) failure report, its fields beside ``t``. Read field by field, whatever
    was sent (``Failure.from_json``), so a malformed report cannot break the verdict that reads it."""

    failure: Failure

    def to_json(self) -> dict[str, Any]:
        return {"t": self.TYPE, **self.failure.to_json()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Error:
        return cls(Failure.from_json(raw))


@message("event")
@dataclasses.dataclass(frozen=True)
class Event(Message):
    """Something for the run's report to record (``orted-launched``: an exec service started ``orted``)."""

    kind: str
    partition: int | None = None
    executor: str | None = None
    rank: int | None = None

    def recorded(self) -> dict[str, Any]:
        """The event as the run's report lists it: its fields that are set."""
        return {k: v for k, v in self.to_json().items() if k != "t" and v is not None}


# -- task -> driver: transfers, each on a connection of its own ------------------------------------
@message("put")
@dataclasses.dataclass(frozen=True)
class PutArtifacts(Message):
    """Rank 0's task: its artifacts (checkpoints, timeline) follow, offered (``artifacts.upload_tree``)."""


@message("fetch-resume")
@dataclasses.dataclass(frozen=True)
class FetchResume(Message):
    """A host leader: send ``resume_from`` (``artifacts.fetch_resume``)."""

    partition: object = None  # the driver serves only the plan's host leaders, once: anything else is hung up on


@message("put-version")
@dataclasses.dataclass(frozen=True)
class PutVersion(Message):
    """Rank 0's task: one checkpoint version follows (its changed files, offered). ``manifest``:
    every file of the version, ``{path: size}``. The fields are checked by the driver's
    ``VersionSink.commit`` against the run's limits, after the transfer, so a bad one is refused in
    the receipt with its reason rather than hung up on: here they are taken as sent."""

    step: object = None
    metrics: object = None
    manifest: object = None


# -- driver -> task --------------------------------------------------------------------------------
@message("plan")
@dataclasses.dataclass(frozen=True)
class Planned(Message):
    """Every task's place: the plan (``plan.make_plan``)."""

    plan: Plan

    def to_json(self) -> dict[str, Any]:
        return {"t": self.TYPE, "plan": self.plan.to_json()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Planned:
        from airflow_provider_horovod.runner.plan import Plan

        try:
            return cls(Plan.from_json(raw["plan"]))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ProtocolError("a plan message whose plan cannot be read: %s" % (err,)) from err


@message("start")
@dataclasses.dataclass(frozen=True)
class Start(Message):
    """Every task is ready: start the ranks."""


@message("stop")
@dataclasses.dataclass(frozen=True)
class Stop(Message):
    """End your ranks now (a rank failed, or the run was cancelled)."""


@message("preempting")
@dataclasses.dataclass(frozen=True)
class Preempting(Message):
    """An executor of the attempt is being decommissioned: tell your ranks (``runtime.preempting()``)."""


@message("release")
@dataclasses.dataclass(frozen=True)
class Release(Message):
    """Every task finished: return your rows."""


# -- the transfer exchange (no ``t``: each is the frame the peer expects next) --------------------
class TransferError(ValueError):
    """The sending side broke the transfer protocol, or went past a limit."""


def safe_relative(name: Any) -> PurePosixPath:
    """``name`` as a relative path that stays inside its folder; ``TransferError`` otherwise."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise TransferError("refusing a file name that is empty or not plain text: %r" % (name,))
    rel = PurePosixPath(name)
    if rel.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise TransferError("refusing a file outside the artifact folder: %r" % (name,))
    return rel


@dataclasses.dataclass(frozen=True)
class Offer:
    """Giver -> taker, first: the folder, a proof file's path and its token (``artifacts.make_offer``),
    or ``None`` (stream only). The taker checks the offer itself (``artifacts.open_offer``)."""

    offer: Mapping[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"offer": None if self.offer is None else dict(self.offer)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Offer:
        offer = raw.get("offer")
        return cls(offer if isinstance(offer, Mapping) else None)


@dataclasses.dataclass(frozen=True)
class Mode:
    """Taker -> giver: ``copy`` (the taker copies the files itself), ``stream`` (send them), or
    ``none`` (this run takes nothing)."""

    mode: str

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Mode:
        mode = raw.get("mode")
        return cls(mode if isinstance(mode, str) else "")

    @property
    def stream(self) -> bool:
        return self.mode == "stream"


@dataclasses.dataclass(frozen=True)
class FileHeader:
    """Giver -> taker, in a stream: the next file, then its ``size`` bytes in frames of their own."""

    file: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> FileHeader:
        """The header, its name inside the folder and its size a byte count; else ``TransferError``."""
        rel = safe_relative(raw.get("file"))
        size = raw.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise TransferError("refusing %s: its size %r is not a byte count" % (rel, size))
        return cls(rel.as_posix(), size)


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    """Giver -> taker: the stream is over, after ``files`` files."""

    files: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"end": True, "files": self.files}

    @staticmethod
    def is_one(raw: Mapping[str, Any]) -> bool:
        return raw.get("end") is True

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StreamEnd:
        files = raw.get("files")
        return cls(files if isinstance(files, int) and not isinstance(files, bool) else None)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Taker -> giver, every 2 s of a same-host copy: still copying, keep waiting."""

    def to_json(self) -> dict[str, Any]:
        return {"copying": True}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Heartbeat:
        return cls()


@dataclasses.dataclass(frozen=True)
class Received:
    """Driver -> rank 0's task, for a checkpoint version: how many files arrived (then ``Intact``)."""

    received: int

    def to_json(self) -> dict[str, Any]:
        return {"received": self.received}

    @staticmethod
    def is_one(raw: Mapping[str, Any]) -> bool:
        return "received" in raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Received:
        count = raw.get("received")
        return cls(count if isinstance(count, int) else 0)


@dataclasses.dataclass(frozen=True)
class Intact:
    """Rank 0's task -> driver: whether every file sent is still as it was when sent."""

    intact: bool

    def to_json(self) -> dict[str, Any]:
        return {"intact": self.intact}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Intact:
        return cls(raw.get("intact") is True)


@dataclasses.dataclass(frozen=True)
class Receipt:
    """Taker -> giver, last: whether the files were stored (``files``: how many), or why not."""

    ok: bool
    error: str | None = None
    files: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok}
        if self.error is not None:
            out["error"] = self.error
        if self.files is not None:
            out["files"] = self.files
        return out

    @staticmethod
    def is_one(raw: Mapping[str, Any]) -> bool:
        return "ok" in raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Receipt:
        error, files = raw.get("error"), raw.get("files")
        return cls(bool(raw.get("ok")), str(error) if error else None, files if isinstance(files, int) else None)


def wait_for(conn: Any, expected: type[Received] | type[Receipt]) -> Any:
    """The next ``expected`` frame on ``conn``; heartbeats and anything else before it are skipped."""
    while not expected.is_one(raw := conn.recv()):
        pass
    return expected.from_json(raw)


# -- the exec service (mpirun's rsh agent <-> a host's exec service; no ``t`` either) --------------
@dataclasses.dataclass(frozen=True)
class LaunchOrted:
    """rsh agent -> exec service: the words Open MPI gave the agent (the ``orted`` command line)."""

    words: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"words": list(self.words)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LaunchOrted:
        words = raw.get("words")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ProtocolError("a request without a list of words")
        return cls(words)


@dataclasses.dataclass(frozen=True)
class OrtedStarted:
    """Exec service -> rsh agent: ``orted`` runs, as process ``pid``."""

    pid: int

    def to_json(self) -> dict[str, Any]:
        return {"started": self.pid}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OrtedStarted:
        pid = raw.get("started")
        return cls(pid if isinstance(pid, int) else -1)  # the agent only waits for it


@dataclasses.dataclass(frozen=True)
class OrtedExited:
    """Exec service -> rsh agent: ``orted`` ended with ``code`` (negative: killed by that signal);
    255 when the service did not say, as ssh reports a lost connection."""

    code: int

    def to_json(self) -> dict[str, Any]:
        return {"exit": self.code}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OrtedExited:
        return cls(int(raw.get("exit", 255)))


# -- rank 0 -> driver: progress and metrics (runtime.report) ----------------------------------------
MAX_METRICS = 64  # names per report: a report is a handful of numbers, never a tensor's worth
MAX_NAME_CHARS = 100
MAX_COUNT = 2**63 - 1  # a step: what MLflow (int64) and every JSON reader take
MAX_TIME = 253402300799.0  # a report's time, seconds since the epoch: 9999-12-31 23:59:59 UTC, what datetime takes


@message("report")
@dataclasses.dataclass(frozen=True)
class Report(Message):
    """Rank 0's progress (``runtime.report``): the step, the steps in all, named numbers, when."""

    time: float
    step: int | None = None
    total_steps: int | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    rank: int | None = None  # set by the channel from the sender's key, never by the sender

    @classmethod
    def make(cls, time: float, step: Any, total_steps: Any, metrics: Mapping[str, Any]) -> Report:
        """A report from what training code passed; ``TypeError``/``ValueError`` that says what to pass."""
        if not 0.0 <= float(time) <= MAX_TIME:  # NaN fails too; any two times are a finite duration apart
            raise ValueError("a report's time must be seconds since the epoch, from 0 to %r; got %r" % (MAX_TIME, time))
        return cls(time=float(time), step=_count("step", step), total_steps=_count("total_steps", total_steps),
                   metrics=_numbers(metrics))

    def to_json(self) -> dict[str, Any]:
        return {"t": self.TYPE, "time": self.time, "step": self.step, "total_steps": self.total_steps,
                "metrics": dict(self.metrics), "rank": self.rank}

    @classmethod
    def from_json(cls, raw: Any) -> Report:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("metrics"), Mapping):
            raise ProtocolError("a report without a metrics object")
        when = raw.get("time")
        if isinstance(when, bool) or not isinstance(when, (int, float)):
            raise ProtocolError("a report without a time")
        rank = raw.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ProtocolError("a report whose rank is not an int")
        try:
            return dataclasses.replace(cls.make(when, raw.get("step"), raw.get("total_steps"), raw["metrics"]), rank=rank)
        except (TypeError, ValueError) as err:
            raise ProtocolError("a malformed report: %s" % err) from None


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError("runtime.report(%s=...) takes an int >= 0 or None; got %r" % (name, value))
    if value > MAX_COUNT:
        raise ValueError("runtime.report(%s=...) takes an int of at most 2**63 - 1; got a larger one" % name)
    return int(value)


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    if len(metrics) > MAX_METRICS:
        raise ValueError("runtime.report takes at most %d metrics; got %d" % (MAX_METRICS, len(metrics)))
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or len(key) > MAX_NAME_CHARS or one_line(key) != key:
            raise ValueError("a metric's name must be a non-empty str of at most %d characters without control "
                             "characters (newline, escape...); got %r" % (MAX_NAME_CHARS, key))
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError("runtime.report(%s=...) takes a number (int or float; call .item() on a tensor); got a %s"
                            % (key, type(value).__qualname__))
        number = float(value)
        if not math.isfinite(number):
            raise ValueError("runtime.report(%s=...) got %r; report finite numbers" % (key, number))
        out[key] = number
    return out


# -- the stall rule (driver/stalls.py) -------------------------------------------------------------
@message("beat")
@dataclasses.dataclass(frozen=True)
class Beat(Message):
    """A rank's pulse (``rank/stacks.py``): how long its main thread's stack has stayed the same,
    where it is, every thread's stack once it has stayed long enough, ``done`` when its function returned."""

    pid: int
    host: str
    idle_s: float
    where: str
    stacks: str | None = None
    done: bool = False
    rank: int | None = None  # set by the channel from the sender's key, never by the sender


@message("rank-states")
@dataclasses.dataclass(frozen=True)
class RankStates(Message):
    """A task's look at its ranks' processes when told to stop, before it kills them
    (``task/rank_states.py``): ``{"1": {"pid": 42, "status": "stopped"}}``, psutil's words."""

    partition: int
    states: dict[str, dict]
