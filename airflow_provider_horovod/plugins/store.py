"""What the Horovod view reads: the committed try folders of one task instance, and nothing else.

A task instance's folders are ``<root>/<dag_id>/<run_id>/<task_id>[/map-<i>]/try-<n>/`` (the
layout ``HorovodRunnerHook.try_folder`` writes), under ``[horovod] artifact_root`` or one of
``[horovod] view_extra_roots``. No path a request names is ever opened as given:

* every id must be one path component (no ``/``, ``\\``, NUL, ``.`` or ``..``), else 400;
* a file is served only when the try's marker (``_ARTIFACTS.json``, written last) lists it;
* on local disk, a file (or a folder on its way) that is a symlink, or that resolves outside
  its try folder, is refused.

Anything refused reads as absent (404), so a probe learns nothing about the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING, Any

from airflow_provider_horovod.runner.artifacts import MARKER, TIMELINE

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

TRY_FOLDER = re.compile(r"^try-([1-9][0-9]{0,6})$")
MAX_TIMELINE_BYTES = 256 << 20  # drawn in the API server's memory; larger ones are only downloadable


class BadRequest(ValueError):
    """A request names something that can never be a task instance's artifact (HTTP 400)."""


class NotFound(LookupError):
    """No such try or file, or one this view refuses to serve (HTTP 404)."""


def component(value: str, what: str) -> str:
    """``value`` if it is a single, harmless path component."""
    if not value or value in (".", "..") or any(c in value for c in "/\\\x00") or len(value) > 512:
        raise BadRequest("%s %r is not a valid Airflow id" % (what, value))
    return value


def roots() -> list[str]:
    """Where the view looks: ``[horovod] artifact_root`` (or its default) and ``[horovod] view_extra_roots``."""
    from airflow.sdk import conf

    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

    found = [HorovodRunnerHook.default_artifact_root()]
    extra = conf.get("horovod", "view_extra_roots", fallback="") or ""
    found += [r.strip() for r in extra.split(",") if r.strip()]
    return found


@dataclasses.dataclass
class StoredFile:
    path: str  # relative to the try folder, with "/"
    size: int | None


@dataclasses.dataclass
class Try:
    """One try of a task instance, as its folder says."""

    number: int
    folder: ObjectStoragePath
    marker: dict[str, Any] | None  # None: not committed (still running, or the worker died)

    @property
    def status(self) -> str:
        if self.marker is None:
            return "running or never committed"
        return str(self.marker.get("status") or "unknown")

    @property
    def committed(self) -> bool:
        return self.marker is not None

    def listed(self) -> list[str]:
        """The files the marker says were stored: the only ones this view serves."""
        if not self.marker:
            return []
        names = self.marker.get("stored_files")
        if not isinstance(names, list):
            names = [f.get("path") for f in self.marker.get("files") or [] if isinstance(f, dict)]
        return sorted({n for n in names if isinstance(n, str) and _relative_ok(n)})

    def files(self) -> list[StoredFile]:
        out = []
        for rel in self.listed():
            with contextlib.suppress(NotFound):
                path = self.file(rel)
                out.append(StoredFile(rel, _size(path)))
        return out

    def file(self, rel: str) -> ObjectStoragePath:
        """The stored file ``rel`` of this try; ``NotFound`` unless the marker lists it and it is safe."""
        if rel not in self.listed():
            raise NotFound(rel)
        path = self.folder / rel
        if path.protocol in ("file", "local", ""):
            _check_local(str(self.folder.path), str(path.path))
        if not path.is_file():
            raise NotFound(rel)
        return path

    def timeline_events(self) -> list[dict[str, Any]] | None:
        """The stored timeline's events, or ``None`` when this try has none (or it is too large to draw)."""
        if TIMELINE not in self.listed():
            return None
        path = self.file(TIMELINE)
        size = _size(path)
        if size is not None and size > MAX_TIMELINE_BYTES:
            return None
        try:
            with path.open("rb") as f:
                events = json.loads(f.read())
        except ValueError:  # not JSON: the engine repairs a cut timeline, so this one is not Horovod's
            return None
        return events if isinstance(events, list) else []


@dataclasses.dataclass
class TaskArtifacts:
    """Every try folder of one task instance."""

    folder: ObjectStoragePath | None  # None: this task instance stored nothing

    @classmethod
    def find(cls, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> TaskArtifacts:
        from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

        parts = [component(dag_id, "dag_id"), component(run_id, "run_id"), component(task_id, "task_id")]
        if map_index >= 0:
            parts.append("map-%d" % map_index)
        for root in roots():
            folder = HorovodRunnerHook.storage_path(root)
            for part in parts:
                folder = folder / part
            if folder.protocol in ("file", "local", ""):
                with contextlib.suppress(NotFound):
                    _check_local(str(HorovodRunnerHook.storage_path(root).path), str(folder.path))
                    if folder.is_dir():
                        return cls(folder)
                continue
            with contextlib.suppress(Exception):
                if folder.is_dir():
                    return cls(folder)
        return cls(None)

    def tries(self) -> list[Try]:
        if self.folder is None:
            return []
        found = []
        with contextlib.suppress(Exception):
            for child in self.folder.iterdir():
                match = TRY_FOLDER.match(child.name)
                if match and child.is_dir():
                    found.append(int(match.group(1)))
        tries = []
        for number in sorted(found):
            with contextlib.suppress(NotFound):  # e.g. a try folder that is a symlink: not shown
                tries.append(self.get(number))
        return tries

    def get(self, number: int) -> Try:
        if self.folder is None or number < 1:
            raise NotFound("try %s" % number)
        folder = self.folder / ("try-%d" % number)
        if folder.protocol in ("file", "local", ""):
            _check_local(str(self.folder.path), str(folder.path))
        if not folder.is_dir():
            raise NotFound("try %s" % number)
        return Try(number, folder, _read_marker(folder))


def _read_marker(folder: ObjectStoragePath) -> dict[str, Any] | None:
    marker = folder / MARKER
    if marker.protocol in ("file", "local", ""):
        try:
            _check_local(str(folder.path), str(marker.path))
        except NotFound:
            return None
    try:
        value = json.loads(marker.read_text())
    except Exception:  # noqa: BLE001 - absent, half-written or not JSON: not committed
        return None
    return value if isinstance(value, dict) else None


def _relative_ok(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and "\x00" not in rel and all(
        p not in ("", ".", "..") for p in parts)


def _check_local(base: str, target: str) -> None:
    """``target`` lies inside ``base`` on local disk with no symlink on the way from ``base``."""
    base_real = os.path.realpath(base)
    target_abs = os.path.abspath(target)
    if os.path.commonpath([os.path.abspath(base), target_abs]) != os.path.abspath(base):
        raise NotFound(target)
    rel = os.path.relpath(target_abs, os.path.abspath(base))
    current = os.path.abspath(base)
    for part in ([] if rel == "." else rel.split(os.sep)):
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise NotFound(target)
    real = os.path.realpath(target_abs)
    if os.path.commonpath([base_real, real]) != base_real:
        raise NotFound(target)


def _size(path: ObjectStoragePath) -> int | None:
    with contextlib.suppress(Exception):
        return int(path.stat()["size"])
    return None
