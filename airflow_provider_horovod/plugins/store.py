"""What the Horovod view reads: the committed try folders of one task instance, and nothing else.

A task instance's folders are the layout of ``airflow_provider_horovod.store``, under
``[horovod] artifact_root`` or one of ``[horovod] view_extra_roots``. No path a request names is ever opened as given:

* every id must be one path component (no ``/``, ``\\``, NUL, ``.`` or ``..``), else 400;
* a file is served only when the try's marker (``_ARTIFACTS.json``, written last) lists it;
* on local disk, everything is opened by descriptor from the root down, one component at a time
  with ``O_NOFOLLOW``, and read from that descriptor: a link anywhere below the root (a file, a try
  folder, a folder on the way), even one swapped in after a check, is refused, never followed.

Anything refused reads as absent (404), so a probe learns nothing about the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import stat
from typing import TYPE_CHECKING, Any, BinaryIO

from airflow_provider_horovod import store
from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner import records
from airflow_provider_horovod.runner import timeline as hvd_timeline
from airflow_provider_horovod.runner.transfer import OPEN_FILE, open_below
from airflow_provider_horovod.store import MARKER, TIMELINE

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

MAX_MARKER_BYTES = 16 << 20  # a version's marker lists its files: far below this
MAX_TIMELINE_BYTES = 64 << 20  # drawn one at a time, its events streamed (N14); larger ones are only downloadable


class BadRequest(ValueError):
    """A request names something that can never be a task instance's artifact (HTTP 400)."""


class NotFound(LookupError):
    """No such try or file, or one this view refuses to serve (HTTP 404)."""


def component(value: str, what: str) -> str:
    """``value`` if it is a single, harmless path component (the rule the store writes by, ``store.check_id``)."""
    try:
        return store.check_id(value, what)
    except ArtifactError:
        raise BadRequest("%s %r is not a valid Airflow id" % (what, value)) from None


def roots() -> list[str]:
    """Where the view looks: ``[horovod] artifact_root`` (or its default) and ``[horovod] view_extra_roots``."""
    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

    return [HorovodRunnerHook.default_artifact_root(), *HorovodRunnerHook.configured_roots("view_extra_roots")]




@dataclasses.dataclass(frozen=True)
class LocalFolder:
    """A folder of a store on local disk: the operator's root (taken as configured) and the
    components below it, each opened by descriptor with ``O_NOFOLLOW`` (``NotFound`` if any fails)."""

    root: str
    parts: tuple[str, ...] = ()

    def child(self, *parts: str) -> LocalFolder:
        return LocalFolder(self.root, self.parts + parts)

    def open_dir(self, *below: str) -> int:
        """A descriptor of this folder (or of ``below`` inside it), reached without following a link."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            raise NotFound(self.root) from None
        try:
            return open_below(fd, self.parts + below)
        except OSError:
            raise NotFound("/".join(self.parts + below)) from None

    def open_file(self, rel: str) -> int:
        """A descriptor of the regular file ``rel`` (``/``-separated) inside this folder, no link followed."""
        *folders, name = rel.split("/")
        dir_fd = self.open_dir(*folders)
        try:
            fd = os.open(name, OPEN_FILE, dir_fd=dir_fd)
        except OSError:
            raise NotFound(rel) from None
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotFound(rel)
        os.set_blocking(fd, True)
        return fd

    def size(self, rel: str) -> int:
        fd = self.open_file(rel)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


def _local(folder: ObjectStoragePath) -> LocalFolder | None:
    return LocalFolder(str(folder.path)) if folder.protocol in ("file", "local", "") else None


@dataclasses.dataclass
class StoredFile:
    path: str  # relative to the try folder, with "/"
    size: int | None


@dataclasses.dataclass
class Try:
    """One try of a task instance, as its folder says."""

    number: int
    folder: ObjectStoragePath
    marker: store.TryMarker | None  # None: not committed (still running, or the worker died)
    local: LocalFolder | None = None  # on local disk: how to reach the folder from its root

    def __post_init__(self) -> None:
        self.local = self.local or _local(self.folder)

    @property
    def status(self) -> str:
        if self.marker is None:
            return "running or never committed"
        return self.marker.status.value if self.marker.status else "unknown"

    @property
    def committed(self) -> bool:
        return self.marker is not None

    @functools.cached_property
    def _listed(self) -> frozenset[str]:
        """Read from the marker once per request (not once per file)."""
        return frozenset(n for n in (self.marker.stored_files if self.marker else ()) if _relative_ok(n))

    def listed(self) -> list[str]:
        """The files the marker says were stored: the only ones this view serves."""
        return sorted(self._listed)

    def files(self) -> list[StoredFile]:
        out = []
        for rel in self.listed():
            with contextlib.suppress(NotFound):  # one walk per file on local disk: open, fstat, close
                out.append(StoredFile(rel, self.local.size(rel) if self.local else _size(self.file(rel))))
        return out

    def versions(self) -> list[dict[str, Any]]:
        """The checkpoint versions committed during this try (a killed try's too), oldest first; on
        local disk each marker is read by descriptor, no link followed (a linked version is not one)."""
        if not self.local:
            return store.describe_versions(self.folder)
        try:
            fd = self.local.open_dir(store.VERSIONS)
        except NotFound:
            return []
        try:
            names = [n for n in os.listdir(fd) if records.is_version_folder(n)]
        finally:
            os.close(fd)
        found = []
        for name in names:
            rel = "%s/%s/%s" % (store.VERSIONS, name, store.VERSION_MARKER)
            with contextlib.suppress(NotFound, ValueError, TypeError, KeyError):
                with os.fdopen(self.local.open_file(rel), "rb") as f:
                    found.append((records.Version.from_json(json.loads(f.read(MAX_MARKER_BYTES))), name))
        return [{**v.to_json(), "uri": str(self.folder / store.VERSIONS / name)}
                for v, name in sorted(found, key=lambda item: item[0].seq)]

    def file(self, rel: str) -> ObjectStoragePath:
        """The stored file ``rel`` of this try; ``NotFound`` unless the marker lists it and it is safe."""
        if rel not in self._listed:
            raise NotFound(rel)
        path = self.folder / rel
        if self.local:
            os.close(self.local.open_file(rel))
        elif not path.is_file():
            raise NotFound(rel)
        return path

    def open(self, rel: str) -> BinaryIO:
        """The stored file ``rel`` opened for reading; on local disk, by descriptor, no link followed."""
        path = self.file(rel)
        if self.local:
            return os.fdopen(self.local.open_file(rel), "rb")
        return path.open("rb")

    def metrics(self, max_rows: int) -> list[dict[str, Any]]:
        """Rank 0's kept reports (``metrics.jsonl``), committed while the try runs, so read whether
        or not the marker lists the file; thinned evenly to ``max_rows``."""
        if not self.local:
            return store.read_metrics(self.folder, max_rows=max_rows)
        try:
            fd = self.local.open_dir(store.METRICS_DIR)
        except NotFound:
            chosen = []
        else:
            try:
                chosen = records.metrics_objects(os.listdir(fd))
            finally:
                os.close(fd)
        if chosen:
            return store.parse_metrics(self._local_lines("%s/%s" % (store.METRICS_DIR, n) for n in chosen),
                                       max_rows=max_rows)
        return store.parse_metrics(self._local_lines([store.METRICS]), max_rows=max_rows)  # the old layout

    def _local_lines(self, rels: Any) -> Any:
        """The lines of these local files in turn, each opened by descriptor (a link or a missing one: skipped)."""
        for rel in rels:
            try:
                f = os.fdopen(self.local.open_file(rel), "rb")
            except NotFound:
                continue
            with f:
                yield from store.bounded_lines(f)

    def timeline(self) -> hvd_timeline.Timeline | None:
        """The stored timeline, parsed as it streams from the file (never held whole in memory), or
        ``None`` when this try has none, or one too large to draw, or one that is not JSON."""
        if TIMELINE not in self._listed:
            return None
        size = self.local.size(TIMELINE) if self.local else _size(self.file(TIMELINE))
        if size is not None and size > MAX_TIMELINE_BYTES:
            return None
        try:
            with self.open(TIMELINE) as f:
                return hvd_timeline.parse(hvd_timeline.iter_events(f))
        except ValueError:  # not JSON: the engine repairs a cut timeline, so this one is not Horovod's
            return None


@dataclasses.dataclass
class TaskArtifacts:
    """Every try folder of one task instance."""

    folder: ObjectStoragePath | None  # None: this task instance stored nothing
    local: LocalFolder | None = None  # on local disk: how to reach the folder from its root

    @classmethod
    def find(cls, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> TaskArtifacts:
        ids = (component(dag_id, "dag_id"), component(run_id, "run_id"), component(task_id, "task_id"))
        below = ids + (("map-%d" % map_index,) if map_index >= 0 else ())
        for root in roots():
            folder = store.task_folder(root, *ids, map_index)
            local = _local(store.storage_path(root))
            if local:
                with contextlib.suppress(NotFound):
                    os.close(local.open_dir(*below))
                    return cls(folder, local.child(*below))
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
        if self.local:
            local = self.local.child(folder.name)
            os.close(local.open_dir())
            return Try(number, folder, _read_local_marker(local), local)
        if not folder.is_dir():
            raise NotFound("try %s" % number)
        return Try(number, folder, store.read_marker(folder))


def _read_local_marker(folder: LocalFolder) -> store.TryMarker | None:
    """The try's marker, read from a descriptor (no link followed); ``None`` if absent or not one."""
    try:
        with os.fdopen(folder.open_file(MARKER), "rb") as f:
            return store.TryMarker.from_json(json.loads(f.read()))
    except (NotFound, ValueError, TypeError, KeyError):
        return None


def _relative_ok(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and "\x00" not in rel and all(
        p not in ("", ".", "..") for p in parts)


def _size(path: ObjectStoragePath) -> int | None:
    with contextlib.suppress(Exception):
        return int(path.stat()["size"])
    return None
