"""What the Horovod view reads: the committed try folders of one task instance, and nothing else.

A task instance's folders are the layout of ``airflow_provider_horovod.store``, under
``[horovod] artifact_root`` or one of ``[horovod] view_extra_roots``. No path a request names is ever opened as given:

* every id must be one path component (no ``/``, ``\\``, NUL, ``.`` or ``..``), else 400;
* a file is served only when the try's marker (``_ARTIFACTS.json``, written last) lists it;
* on local disk, a file (or a folder on its way) that is a symlink, or that resolves outside
  its try folder, is refused.

Anything refused reads as absent (404), so a probe learns nothing about the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING, Any

from airflow_provider_horovod import store
from airflow_provider_horovod.runner import timeline as hvd_timeline
from airflow_provider_horovod.store import MARKER, TIMELINE

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

MAX_TIMELINE_BYTES = 64 << 20  # drawn one at a time, its events streamed (N14); larger ones are only downloadable


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

    @functools.cached_property
    def _listed(self) -> frozenset[str]:
        """Read from the marker once per request (not once per file)."""
        parsed = store.TryMarker.from_json(self.marker) if self.marker else None
        return frozenset(n for n in (parsed.stored_files if parsed else ()) if _relative_ok(n))

    def listed(self) -> list[str]:
        """The files the marker says were stored: the only ones this view serves."""
        return sorted(self._listed)

    def files(self) -> list[StoredFile]:
        out = []
        for rel in self.listed():
            with contextlib.suppress(NotFound):
                path = self.file(rel)
                out.append(StoredFile(rel, _size(path)))
        return out

    def versions(self) -> list[dict[str, Any]]:
        """The checkpoint versions committed during this try (a killed try's too), oldest first."""
        if self.folder.protocol in ("file", "local", ""):
            with contextlib.suppress(NotFound):
                _check_local(str(self.folder.path), str((self.folder / store.VERSIONS).path))
                return store.describe_versions(self.folder)
            return []
        return store.describe_versions(self.folder)

    def file(self, rel: str) -> ObjectStoragePath:
        """The stored file ``rel`` of this try; ``NotFound`` unless the marker lists it and it is safe."""
        if rel not in self._listed:
            raise NotFound(rel)
        path = self.folder / rel
        if path.protocol in ("file", "local", ""):
            _check_local(str(self.folder.path), str(path.path))
        if not path.is_file():
            raise NotFound(rel)
        return path

    def timeline(self) -> hvd_timeline.Timeline | None:
        """The stored timeline, parsed as it streams from the file (never held whole in memory), or
        ``None`` when this try has none, or one too large to draw, or one that is not JSON."""
        if TIMELINE not in self._listed:
            return None
        path = self.file(TIMELINE)
        size = _size(path)
        if size is not None and size > MAX_TIMELINE_BYTES:
            return None
        try:
            with path.open("rb") as f:
                return hvd_timeline.parse(hvd_timeline.iter_events(f))
        except ValueError:  # not JSON: the engine repairs a cut timeline, so this one is not Horovod's
            return None


@dataclasses.dataclass
class TaskArtifacts:
    """Every try folder of one task instance."""

    folder: ObjectStoragePath | None  # None: this task instance stored nothing

    @classmethod
    def find(cls, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> TaskArtifacts:
        ids = (component(dag_id, "dag_id"), component(run_id, "run_id"), component(task_id, "task_id"))
        for root in roots():
            folder = store.task_folder(root, *ids, map_index)
            if folder.protocol in ("file", "local", ""):
                with contextlib.suppress(NotFound):
                    _check_local(str(store.storage_path(root).path), str(folder.path))
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
        tries = []
        for number in store.try_numbers(self.folder):
            with contextlib.suppress(NotFound):  # e.g. a try folder that is a symlink: not shown
                tries.append(self.get(number))
        return tries

    def get(self, number: int) -> Try:
        if self.folder is None or number < 1:
            raise NotFound("try %s" % number)
        folder = store.try_folder(self.folder, number)
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
    parsed = store.read_marker(folder)
    return parsed.to_json() if parsed is not None else None


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
