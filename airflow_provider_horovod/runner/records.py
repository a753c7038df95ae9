"""What the runner and the store save, one typed record each, and the one layout of the folders
they save it in.

A record has one writer (``to_json``) and one reader (``from_json``), and every record written
carries ``"schema": SCHEMA``. Records written before schemas (0.1.0 and main until 2026-12-05)
have no ``schema`` key and read as schema 0 (``docs/versions.md``): the try marker of schema 0 is
the engine's and the operator's keys merged into one object, and is split into its two parts on
reading. A record of a newer schema than this code knows is read for the fields this code knows
(fields are only ever added within one major version).

The layout (``Layout``) is the same for the engine's ``artifact_dir`` (a ``Path``) and a try
folder in the artifact store (an ``ObjectStoragePath``)::

    versions/<seq>/...             a checkpoint version (seq: 000001, ...)
    versions/<seq>/_VERSION.json   its marker (``Version``), written after its files
    checkpoints/...                rank 0's checkpoint folder as the run ended
    timeline.json  timeline_summary.json  timeline.svg
    _RUN.json                      the engine's marker (``RunMarker``), written last by the engine
    metrics/<n>[.base].jsonl       the store's: rank 0's kept reports (``MetricsRow``), one a line,
                                   appended as numbered objects; a reader starts at the newest base
    metrics.jsonl                  the same, as one file, in try folders written before 2026-12-06
    result.pkl                     the store's: rank 0's return value when it is not JSON
    _ARTIFACTS.json                the store's marker (``TryMarker``), written last by the store
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.events import RunStatus

SCHEMA = 1

VERSIONS = "versions"
VERSION_MARKER = "_VERSION.json"
RUN_MARKER = "_RUN.json"
TRY_MARKER = "_ARTIFACTS.json"
CHECKPOINTS = names.CHECKPOINTS_DIR
TIMELINE = names.TIMELINE_FILE
SUMMARY = "timeline_summary.json"
PICTURE = "timeline.svg"
METRICS = "metrics.jsonl"
METRICS_DIR = "metrics"
_METRICS_OBJECT = re.compile(r"^([0-9]{6,})(\.base)?\.jsonl$")
RESULT = names.RESULT_FILE
_VERSION_NAME = re.compile(r"^[0-9]{6,}$")


def is_version_folder(name: str) -> bool:
    """Whether ``name`` is a committed version's folder name (a version being built is ``.<seq>.partial``)."""
    return bool(_VERSION_NAME.match(name))


def version_name(seq: int) -> str:
    return "%06d" % seq


def metrics_object_name(seq: int, *, base: bool) -> str:
    """The name of the ``seq``-th metrics object of a try: a base holds every row kept so far, the
    others the rows after the object before them."""
    return "%06d%s.jsonl" % (seq, ".base" if base else "")


def metrics_objects(names: Any) -> list[str]:
    """Of the names in ``metrics/``, the objects to read, in order: the newest base and every one after it."""
    found = sorted((int(m.group(1)), bool(m.group(2)), name)
                   for name in names for m in [_METRICS_OBJECT.match(name)] if m)
    start = max((i for i, (_seq, base, _name) in enumerate(found) if base), default=0)
    return [name for _seq, _base, name in found[start:]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The names in one artifact folder; ``root`` is a ``Path`` or an ``ObjectStoragePath``."""

    root: Any

    versions = property(lambda self: self.root / VERSIONS)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    metrics = property(lambda self: self.root / METRICS)
    metrics_dir = property(lambda self: self.root / METRICS_DIR)
    run_marker = property(lambda self: self.root / RUN_MARKER)
    try_marker = property(lambda self: self.root / TRY_MARKER)

    def version(self, seq: int) -> Any:
        return self.versions / version_name(seq)

    def read_run_marker(self) -> RunMarker | None:
        return load(self.run_marker, RunMarker)

    def read_try_marker(self) -> TryMarker | None:
        return load(self.try_marker, TryMarker)

    def committed_versions(self) -> list[tuple[Version, Any]]:
        """The committed versions, oldest first: a version folder whose marker reads as a ``Version``."""
        found = []
        for child in self._version_folders():
            with contextlib.suppress(Exception):  # no marker yet, half a marker, a store error: not committed
                found.append((Version.from_json(json.loads((child / VERSION_MARKER).read_text())), child))
        return sorted(found, key=lambda item: item[0].seq)

    def _version_folders(self) -> Iterator[Any]:
        with contextlib.suppress(Exception):  # no versions folder: no version
            for child in self.versions.iterdir():
                if is_version_folder(child.name):
                    yield child


def load(path: Any, record: Any) -> Any:
    """The ``record`` (a class of this module) saved at ``path``; ``None`` when it is absent,
    half-written or not one."""
    with contextlib.suppress(Exception):  # OSError, ValueError, or whatever a store raises
        return record.from_json(json.loads(path.read_text()))
    return None


def schema_of(value: Mapping[str, Any]) -> int:
    """The schema a saved record says it has; 0 for one written before schemas."""
    schema = value.get("schema", 0)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 0:
        raise ValueError("a record whose schema is not an int >= 0: %r" % (schema,))
    return schema


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError("%s is not a JSON object" % what)
    schema_of(value)
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# -- a checkpoint version's marker ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Version:
    """``versions/<seq>/_VERSION.json``: one committed checkpoint version: its number in the run,
    the user's step and metrics, when, how large, every file with its size, and which of them
    travelled (the others were unchanged)."""

    seq: int
    step: int | None
    time: float
    size: int
    files: tuple[tuple[str, int], ...]
    sent: tuple[str, ...] = ()
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "seq": self.seq, "step": self.step, "time": self.time, "size": self.size,
                "files": [{"path": p, "size": s} for p, s in self.files], "sent": list(self.sent),
                "metrics": self.metrics}

    @classmethod
    def from_json(cls, value: Any) -> Version:
        value = _object(value, "a version marker")
        files = tuple((str(f["path"]), int(f["size"])) for f in value["files"])
        return cls(seq=int(value["seq"]), step=_optional_int(value.get("step")), time=float(value["time"]),
                   size=int(value["size"]), files=files, sent=tuple(value.get("sent") or ()),
                   metrics=dict(value.get("metrics") or {}))


# -- rank 0's commit_checkpoint call, in its task folder until shipped --------------------------------
@dataclasses.dataclass(frozen=True)
class CommitRequest:
    """``_COMMIT.json`` in a ``runtime.commit_checkpoint`` snapshot: the step and metrics the call
    gave (checked by ``report()``'s rules at the call) and when."""

    FILE = "_COMMIT.json"

    time: float
    step: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "time": self.time, "step": self.step, "metrics": dict(self.metrics)}

    @classmethod
    def from_json(cls, value: Any) -> CommitRequest:
        value = _object(value, "a commit request")
        return cls(time=float(value.get("time") or 0.0), step=_optional_int(value.get("step")),
                   metrics=dict(value.get("metrics") or {}))


# -- a line of metrics.jsonl ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MetricsRow:
    """One of rank 0's kept reports (``runtime.report``): step, steps in all, when, and the named
    numbers (``values``; ``Report.metrics`` on the wire)."""

    time: float
    step: int | None = None
    total_steps: int | None = None
    values: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, report: Any) -> MetricsRow:
        """The row of a ``messages.Report``."""
        return cls(time=report.time, step=report.step, total_steps=report.total_steps, values=dict(report.metrics))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "step": self.step, "total_steps": self.total_steps, "time": self.time,
                "values": dict(self.values)}

    def to_line(self) -> str:
        return json.dumps(self.to_json(), allow_nan=False)

    @classmethod
    def from_json(cls, value: Any) -> MetricsRow:
        value = _object(value, "a metrics row")
        if not isinstance(value.get("values"), Mapping):
            raise ValueError("a metrics row without values")
        row = cls(time=float(value.get("time") or 0.0), step=_optional_int(value.get("step")),
                  total_steps=_optional_int(value.get("total_steps")), values=dict(value["values"]))
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (row.time, *row.values.values())):
            raise ValueError("a metrics row whose time or values are not finite numbers")  # JSON has no Infinity
        return row

    @classmethod
    def from_line(cls, line: str | bytes) -> MetricsRow | None:
        """The row on ``line``; ``None`` for a line that is not one (cut by a commit elsewhere, not ours)."""
        try:
            return cls.from_json(json.loads(line))
        except (ValueError, TypeError, OverflowError):  # OverflowError: a step of Infinity
            return None


# -- the engine's marker ----------------------------------------------------------------------------
TIMELINE_KEYS = ("timeline", "timeline_summary", "timeline_picture", "timeline_error")


@dataclasses.dataclass(frozen=True)
class RunMarker:
    """``_RUN.json`` in the engine's ``artifact_dir``, written last: how the run ended, whether what
    rank 0 handed over arrived whole, which files did, and the names of its checkpoint and timeline."""

    status: str | None
    complete: bool
    run_id: str | None = None
    files: tuple[dict[str, Any], ...] = ()  # {"path": ..., "size": ...} as received
    committed_at: float | None = None
    checkpoint: str | None = None  # CHECKPOINTS when rank 0 handed a checkpoint folder over
    timeline: dict[str, str] = dataclasses.field(default_factory=dict)  # TIMELINE_KEYS that apply
    staging: str | None = None  # an incomplete hand-over's folder
    np: int | None = None
    launcher: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "status": self.status, "complete": self.complete, "run_id": self.run_id,
                "files": list(self.files), "committed_at": self.committed_at, "checkpoint": self.checkpoint,
                "timeline": dict(self.timeline), "staging": self.staging, "np": self.np, "launcher": self.launcher}

    @classmethod
    def from_json(cls, value: Any) -> RunMarker:
        value = _object(value, "the engine's marker")
        if schema_of(value) == 0:  # the timeline's names were top-level keys, "timeline" one of them
            timeline = {k: value[k] for k in TIMELINE_KEYS if isinstance(value.get(k), str)}
        else:
            timeline = {k: v for k, v in (value.get("timeline") or {}).items() if k in TIMELINE_KEYS and isinstance(v, str)}
        return cls(status=_optional_str(value.get("status")), complete=value.get("complete") is True,
                   run_id=_optional_str(value.get("run_id")),
                   files=tuple(f for f in value.get("files") or () if isinstance(f, dict)),
                   committed_at=value.get("committed_at"), checkpoint=_optional_str(value.get("checkpoint")),
                   timeline=timeline, staging=_optional_str(value.get("staging")), np=value.get("np"),
                   launcher=_optional_str(value.get("launcher")))


# -- the store's marker of a try ------------------------------------------------------------------------
class TryStatus(str, enum.Enum):
    """How a try ended, as its marker says: the engine's end states (``RunStatus``)."""

    SUCCESS = RunStatus.SUCCESS.value
    FAILED = RunStatus.FAILED.value
    CANCELLED = RunStatus.CANCELLED.value


def _try_status(value: Any) -> TryStatus | None:
    with contextlib.suppress(ValueError):
        return TryStatus(value)
    return None


_TRY_FIELDS = ("try_number", "np", "run_id", "launcher", "duration_s", "resumed_from", "resumed_from_try",
               "resumed_from_step", "error", "committed_at", "attempts", "not_stored")


@dataclasses.dataclass(frozen=True)
class TryMarker:
    """``_ARTIFACTS.json``, the try's one commit point, written last by the store: how the try
    ended (``status``), the files stored, what the operator knows of
    the try, and the engine's own marker (``run``) as the engine wrote it."""

    status: TryStatus | None
    complete: bool
    stored_files: tuple[str, ...] = ()
    try_number: int | None = None
    np: int | None = None
    run_id: str | None = None
    launcher: str | None = None
    duration_s: float | None = None
    resumed_from: str | None = None
    resumed_from_try: int | None = None
    resumed_from_step: int | None = None
    error: dict[str, Any] | None = None  # events.Failure's JSON
    committed_at: float | None = None
    attempts: tuple[dict[str, Any], ...] = ()  # RunReport.attempts: the barrier stages of this try
    not_stored: tuple[dict[str, Any], ...] = ()  # {"seq", "step", "reason"}: versions that never reached the store
    run: RunMarker | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, "status": self.status.value if self.status else None, "complete": self.complete,
               "stored_files": list(self.stored_files)}
        out.update((name, getattr(self, name)) for name in _TRY_FIELDS)
        out["attempts"] = list(self.attempts)
        out["not_stored"] = list(self.not_stored)
        out["run"] = self.run.to_json() if self.run is not None else None
        return out

    @classmethod
    def from_json(cls, value: Any) -> TryMarker:
        value = _object(value, "a try marker")
        stored = value.get("stored_files")
        if not isinstance(stored, list):
            stored = [f.get("path") for f in value.get("files") or [] if isinstance(f, dict)]
        if schema_of(value) == 0:  # one object: the engine's keys with the operator's merged over them
            run = RunMarker.from_json(value) if "run_id" in value or "files" in value else None
        else:
            run = RunMarker.from_json(value["run"]) if isinstance(value.get("run"), Mapping) else None
        fields = {name: value.get(name) for name in _TRY_FIELDS}
        if not isinstance(fields["error"], dict):
            fields["error"] = None
        fields["attempts"] = tuple(a for a in fields["attempts"] or () if isinstance(a, dict))
        fields["not_stored"] = tuple(a for a in fields["not_stored"] or () if isinstance(a, dict))
        return cls(status=_try_status(value.get("status")), complete=value.get("complete") is True,
                   stored_files=tuple(n for n in stored if isinstance(n, str)), run=run, **fields)
