"""The artifact store: where a task instance's tries and checkpoint versions live, and what their
markers say. The hook, the try's recorder (``recorder.py``) and the Horovod view call it; none of
them spells a path but the view, which walks a task's folder on local disk one name at a time
(``plugins/store.py``: its ``map-<i>``).

The layout, under the artifact root (any ``ObjectStoragePath`` URL)::

    <dag_id>/<run_id>/<task_id>[/map-<i>]/try-<n>/   a try folder: ``records.Layout``, as the engine's
                                                      artifact_dir, plus the store's own: metrics/,
                                                      result.pkl and the try's marker _ARTIFACTS.json,
                                                      written last

A version counts only once its marker is there, so a reader never sees half a version as
complete. A try that never wrote its final marker (its task process was killed) still offers
its committed versions. The newest checkpoint of a try is its ``checkpoints/`` when the try
ended with a complete marker, else its newest committed version.

Object-store semantics throughout, the same on ``file://`` and ``s3://``: a marker is one PUT,
written after every object it names; a version is a prefix whose marker comes last; metrics are
appended as new numbered objects and never rewritten; pruning deletes a version's marker first,
then its objects. Nothing relies on rename, directories or ``rmdir``, and a reader uses only the
objects a marker names (metrics objects, each one whole PUT, are read from the newest base on).
Large files go up in parallel parts of ``PART_BYTES`` (at most ``PARTS`` in flight: memory stays
within ``PARTS * PART_BYTES`` per upload); ``VersionUploads`` runs them in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import ArtifactError, ArtifactSettingsError
from airflow_provider_horovod.runner import records
from airflow_provider_horovod.runner.hardlinks import link_tree
from airflow_provider_horovod.runner.records import (
    CHECKPOINTS,
    METRICS,
    METRICS_DIR,
    RESULT,
    RUN_MARKER,
    TRY_MARKER,
    VERSION_MARKER,
    VERSIONS,
    Layout,
    MetricsRow,
    TryMarker,
    Version,
)

MARKER = TRY_MARKER
TryStatus = records.TryStatus
TIMELINE = records.TIMELINE
RESULT_FILE = RESULT
MAX_ID_CHARS = 512
_ID_RULE = "not empty, not . or .., no /, \\ or NUL, at most %d characters" % MAX_ID_CHARS
TRY_FOLDER = re.compile(r"^try-([1-9][0-9]{0,6})$")
log = logging.getLogger(__name__)
LOCAL_PROTOCOLS = ("file", "local", "")
STATE_KEY = "horovod_checkpoint"  # the task_state_store key of the newest committed version
PART_BYTES = 8 << 20  # a file larger than two parts goes up as a multipart upload of parts this size ...
PARTS = 4  # ... at most this many at once


# -- the layout ---------------------------------------------------------------------------------
def storage_path(uri: Any) -> Any:
    """An ``ObjectStoragePath`` for ``uri``; a plain path is a local ``file://`` path."""
    from airflow.sdk import ObjectStoragePath

    uri = str(uri)
    if "://" not in uri:
        uri = "file://" + os.path.abspath(os.path.expanduser(uri))
    return ObjectStoragePath(uri)


def task_folder(root: Any, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Any:
    """``<root>/<dag_id>/<run_id>/<task_id>[/map-<i>]``: every try of one task instance; an
    ``ArtifactSettingsError`` for an id that is not one folder of that layout (``check_id``)."""
    folder = storage_path(root) / check_id(dag_id, "dag_id") / check_id(run_id, "run_id") / check_id(task_id, "task_id")
    return folder / ("map-%d" % map_index) if map_index >= 0 else folder


def check_id(value: str, what: str) -> str:
    """``value`` if it names one folder below its parent: ``.`` and ``..`` are allowed by Airflow's
    default run_id pattern but would put a run's artifacts outside its DAG's folder, where the view
    cannot show them (issue 49); a separator or NUL would go deeper. The view asks the same."""
    if not value or value in (".", "..") or any(c in value for c in "/\\\x00") or len(value) > MAX_ID_CHARS:
        raise ArtifactSettingsError(
            "The %s %r cannot name a folder of the artifact store (%s): trigger the run with another run_id (the "
            "Trigger form's or the REST API's dag_run_id), or rename the DAG or task." % (what, value, _ID_RULE))
    return value


def try_folder(task: Any, try_number: int) -> Any:
    return task / ("try-%d" % try_number)


def try_numbers(task: Any) -> list[int]:
    """The tries of a task folder, oldest first (folders named ``try-<n>`` only)."""
    found = []
    with contextlib.suppress(Exception):
        for child in task.iterdir():
            match = TRY_FOLDER.match(child.name)
            if match and child.is_dir():
                found.append(int(match.group(1)))
    return sorted(found)


def checkpoints_of(folder: Any) -> Any:
    return folder / CHECKPOINTS


def prepare_try(root: Any, *, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> Any:
    """The try's folder, created and proven writable before anything runs; ``ArtifactError`` if not."""
    root_path = storage_path(root)
    folder = try_folder(task_folder(root_path, dag_id, run_id, task_id, map_index), try_number)
    probe = folder / ".write-probe"
    try:
        if is_local(folder):
            folder.mkdir(parents=True, exist_ok=True)  # an object store has no folders (and s3fs would create a bucket)
        _put_bytes(probe, b"ok")
        _delete([probe])
        exists = (folder / MARKER).exists()
    except Exception as err:  # noqa: BLE001 - any storage error means "cannot write here"
        raise ArtifactError(
            "Cannot write Horovod artifacts under %s (%s: %s). Point artifact_root (or [horovod] "
            "artifact_root) at a location this worker can write, and check its connection "
            "(an s3:// root needs the bucket, its endpoint and the IAM actions of docs/how-to.md)."
            % (root_path, type(err).__name__, err)
        ) from err
    if exists:
        raise ArtifactError("%s already holds a committed run; refusing to overwrite it." % folder)
    return folder


# -- the try's final marker ---------------------------------------------------------------------
def read_marker(folder: Any) -> TryMarker | None:
    """The try's final marker, or ``None`` while the try runs (or when it was killed)."""
    return Layout(folder).read_try_marker()


def _write_json_last(folder: Any, name: str, value: dict[str, Any]) -> None:
    """A marker: one PUT, after everything it names (a reader reads half a marker as none)."""
    _put_bytes(folder / name, json.dumps(value, indent=1, default=str).encode())


def store_try(local_dir: str | Path, folder: Any, marker: TryMarker, *,
              extra_files: dict[str, bytes] | None = None) -> TryMarker:
    """Copy the engine's committed ``local_dir`` (and ``extra_files``) into ``folder``, then write the
    final marker last: the try's one commit point. ``marker`` is the recorder's part; the stored
    files, the engine's own marker (``run``) and whether the engine had all of rank 0's hand-over
    (``complete``) are filled in here. The versions are already in the
    store (``commit_version``)."""
    local = Path(local_dir)
    run = Layout(local).read_run_marker()
    files = []
    try:
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local).as_posix()
            if path.is_dir() or any(part.startswith(".") for part in rel.split("/")) or rel.startswith(VERSIONS + "/"):
                continue  # dot-names are the engine's unfinished transfers; versions went up as committed
            if rel == RUN_MARKER:
                continue  # kept inside the try's marker
            if rel in (METRICS, RESULT, MARKER) or rel.startswith(METRICS_DIR + "/"):
                continue  # the store's own files: nothing in the engine's folder replaces them
            _upload(path, folder / rel)
            files.append(rel)
        for rel, data in sorted((extra_files or {}).items()):
            _put_bytes(folder / rel, data)
            files.append(rel)
        committed = dataclasses.replace(marker, complete=run is not None and run.complete, stored_files=tuple(files),
                                        run=run, committed_at=time.time())
        _write_json_last(folder, MARKER, committed.to_json())
    except Exception as err:  # noqa: BLE001 - every storage error: say where and why
        raise ArtifactError("Cannot store the try's artifacts in %s (%s: %s); the try has no final marker, its "
                            "committed versions stay offered." % (folder, type(err).__name__, err)) from err
    return committed


# -- checkpoint versions --------------------------------------------------------------------------
def commit_version(folder: Any, local_version: Path, version: Version, *, keep: int) -> Any:
    """Upload one version the engine committed (``local_version``) into the try ``folder``; its
    marker goes last. Older versions are pruned to ``keep`` only after this one is committed.
    A store that fails midway leaves no marker: the previous version stays the newest."""
    target = Layout(folder).version(version.seq)
    try:
        for rel, _size in version.files:
            _upload(local_version / rel, target / rel)
        _write_json_last(target, VERSION_MARKER, version.to_json())
    except Exception as err:  # noqa: BLE001 - every storage error: say where and why
        raise ArtifactError("Cannot commit checkpoint version %d to %s (%s: %s); the newest committed version "
                            "is still the one before." % (version.seq, target, type(err).__name__, err)) from err
    prune_versions(folder, keep)
    return target


class VersionUploads:
    """The store's tier of durable checkpoints: the driver commits each version in its local
    staging at link speed and ``offer``s it here, which returns at once; one background thread
    uploads it (``commit_version``, in parallel parts) and then calls ``on_stored``. A slow store
    coalesces: only the newest version waiting is kept (an older one waiting is dropped, never
    queued), so memory and local disk stay bounded by one upload and one waiting version.

    An offered version is hard-linked into ``staging`` (copied where links do not work): the
    engine prunes its own copy as it likes. ``close(timeout)`` waits for the last upload, at most
    ``timeout`` seconds, and says what did not make it (``not_stored``)."""

    def __init__(self, folder: Any, staging: Path, *, keep: int,
                 on_stored: Callable[[Version, Any], None] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.folder, self.staging, self.keep = folder, Path(staging), keep
        self.on_stored, self.on_error = on_stored, on_error
        self.not_stored: list[dict[str, Any]] = []  # {"seq", "step", "reason"} of every version that did not make it
        self.stored: list[int] = []
        self._cond = threading.Condition()
        self._waiting: tuple[Version, Path] | None = None
        self._busy: Version | None = None  # the version uploading now
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hvd-store-uploads", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    @property
    def uploading(self) -> int | None:
        """The seq of the version uploading now (``None``: none)."""
        with self._cond:
            return self._busy.seq if self._busy is not None else None

    def __call__(self, version: Version, local: Path) -> None:  # the engine's on_checkpoint
        self.offer(version, local)

    def offer(self, version: Version, local: Path) -> None:
        staged = self.staging / records.version_name(version.seq)
        link_tree(local, staged, version_files(version), copy=shutil.copyfile)
        with self._cond:
            if self._closed:
                shutil.rmtree(staged, ignore_errors=True)
                return
            dropped, self._waiting = self._waiting, (version, staged)
            self._cond.notify_all()
        if dropped is not None:
            self._skip(dropped[0], "coalesced: version %d came before it was uploaded" % version.seq)
            shutil.rmtree(dropped[1], ignore_errors=True)

    def close(self, timeout: float) -> list[dict[str, Any]]:
        """Wait (at most ``timeout`` s) for the upload running and the version waiting; what did not make it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._busy is not None or self._waiting is not None) and time.monotonic() < deadline:
                self._cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            self._closed = True
            left, self._waiting = self._waiting, None
            running = self._busy
            self._cond.notify_all()
        if left is not None:
            self._skip(left[0], "still waiting for its upload when the try ended (%.0f s)" % timeout)
        if running is not None:
            self._skip(running, "its upload was still running when the try ended (%.0f s)" % timeout)
        return list(self.not_stored)

    def _skip(self, version: Version, reason: str) -> None:
        self.not_stored.append({"seq": version.seq, "step": version.step, "reason": reason})

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                (version, staged), self._waiting = self._waiting, None
                self._busy = version
            try:
                path = commit_version(self.folder, staged, version, keep=self.keep)
                self.stored.append(version.seq)
                if self.on_stored is not None:
                    self.on_stored(version, path)
            except Exception as err:  # noqa: BLE001 - the next version tries again; the try's marker says it
                self._skip(version, str(err))
                if self.on_error is not None:
                    self.on_error(str(err))
            finally:
                shutil.rmtree(staged, ignore_errors=True)
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()


def versions(folder: Any) -> list[tuple[Version, Any]]:
    """The committed versions of a try, oldest first (a folder without its marker is not one)."""
    return Layout(folder).committed_versions()


def prune_versions(folder: Any, keep: int) -> None:
    """Remove all but the ``keep`` newest committed versions: marker first, so none is half
    offered, then the objects it named, then whatever else is left under its prefix."""
    for version, path in versions(folder)[:-keep] if keep > 0 else []:
        with contextlib.suppress(Exception):
            _delete([path / VERSION_MARKER])
            _delete([path / rel for rel, _size in version.files])
            _sweep(path)


def _sweep(path: Any) -> None:
    """Whatever is left under ``path`` (empty folders on local disk, objects a failed upload left)."""
    if is_local(path):
        shutil.rmtree(str(path.path), ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.fs.rm(path.path, recursive=True)


# -- the try's metrics --------------------------------------------------------------------------
class MetricsLog:
    """The try's ``metrics/``: each commit is one new numbered object (one PUT), never a rewrite.
    ``append(rows)`` adds the rows since the last commit; ``append(rows, base=True)`` holds every
    row kept (the recorder thinned its file): readers start at the newest base, and the objects
    before it are deleted after it is there (so the store holds about ``metrics.MAX_BYTES``)."""

    def __init__(self, folder: Any) -> None:
        self.folder = folder
        self.seq = 0
        self.written: list[str] = []  # names since the newest base, that base included

    def append(self, data: bytes, *, base: bool = False) -> None:
        name = records.metrics_object_name(self.seq + 1, base=base)
        _put_bytes(self.folder / METRICS_DIR / name, data)
        self.seq += 1
        if base:
            older, self.written = self.written, [name]
            with contextlib.suppress(Exception):  # a reader starts at the base: older objects are only space
                _delete([self.folder / METRICS_DIR / n for n in older])
        else:
            self.written.append(name)


def read_metrics(folder: Any, *, max_rows: int) -> list[dict[str, Any]]:
    """The try's kept reports, oldest first, thinned evenly to at most ``max_rows`` (``parse_metrics``):
    the ``metrics/`` objects from the newest base on, or a ``metrics.jsonl`` of the old layout."""
    try:
        names = [child.name for child in Layout(folder).metrics_dir.iterdir()]
    except Exception:  # noqa: BLE001 - no metrics/ (old layout, or no report yet)
        names = []
    chosen = records.metrics_objects(names)
    if not chosen:
        try:
            with (folder / METRICS).open("rb") as f:
                return parse_metrics(bounded_lines(f), max_rows=max_rows)
        except Exception:  # noqa: BLE001 - absent (no report yet) or unreadable: nothing to show
            return []
    return parse_metrics(_object_lines(Layout(folder).metrics_dir / n for n in chosen), max_rows=max_rows)


def _object_lines(paths: Any) -> Iterator[bytes]:
    for path in paths:
        try:
            with path.open("rb") as f:
                yield from bounded_lines(f)
        except FileNotFoundError:  # replaced by a newer base since the listing: its rows are there
            continue


MAX_ROW_BYTES = 1 << 16  # a row the recorder writes is a few KiB at most (64 metrics, 100-character names)


def bounded_lines(f: Any, limit: int = MAX_ROW_BYTES) -> Iterator[bytes]:
    """The lines of the binary file ``f``, each read whole only up to ``limit`` bytes: a longer
    line (not one the recorder wrote) is skipped without being held."""
    if not isinstance(f, io.BufferedReader):
        f = io.BufferedReader(f)  # a store's file object (fsspec's) reads a line whole, however long
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(limit)


def parse_metrics(lines: Any, *, max_rows: int) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` (bytes or str lines), oldest first, at most ``max_rows`` spread
    evenly over the whole try, and the newest row last. Memory stays within ``2 * max_rows`` rows:
    whenever that many are held, every other one goes, and from then on every second row is read."""
    kept: list[dict[str, Any]] = []
    stride, seen, newest = 1, 0, None
    for line in lines:
        parsed = MetricsRow.from_line(line)
        if parsed is None:
            continue  # a line cut by a commit in progress elsewhere, or not ours
        row = parsed.to_json()
        newest, seen = row, seen + 1
        if (seen - 1) % stride == 0:
            kept.append(row)
            if len(kept) >= 2 * max_rows:
                kept, stride = kept[::2], stride * 2
    if len(kept) > max_rows:
        kept = kept[::-(-len(kept) // max_rows)]
    if newest is not None and kept[-1] is not newest:
        kept.append(newest)
    return kept


# -- what a try offers, and the resume search -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint in the store: where it is, which try made it, and at which step."""

    path: Any
    try_number: int | None
    step: int | None = None
    seq: int | None = None
    files: tuple[str, ...] | None = None  # what its marker names, relative to path (None: a folder named by hand)

    def describe(self) -> str:
        where = "try %s" % self.try_number if self.try_number is not None else "an earlier run"
        if self.seq is None:
            return "%s (%s, as it ended)" % (self.path, where)
        return "%s (%s, version %d%s)" % (self.path, where, self.seq,
                                          ", step %d" % self.step if self.step is not None else "")


def _try_number(folder: Any) -> int | None:
    match = TRY_FOLDER.match(folder.name or "")
    return int(match.group(1)) if match else None


def newest_checkpoint(folder: Any) -> Checkpoint | None:
    """The try's newest complete checkpoint: ``checkpoints/`` of a try that ended with a complete
    marker that names files in it, else its newest committed version (a killed try's too)."""
    marker = read_marker(folder)
    if marker is not None and marker.complete:
        files = tuple(rel[len(CHECKPOINTS) + 1:] for rel in marker.stored_files if rel.startswith(CHECKPOINTS + "/"))
        if files:
            return Checkpoint(checkpoints_of(folder), _try_number(folder), files=files)
    committed = versions(folder)
    if committed:
        version, path = committed[-1]
        return Checkpoint(path, _try_number(folder), version.step, version.seq, files=version_files(version))
    return None


def version_files(version: Version) -> tuple[str, ...]:
    """What a version's marker names: the only objects of its prefix a reader uses."""
    return tuple(rel for rel, _size in version.files)


def latest_checkpoint(folder: Any, try_number: int, since: int = 1) -> Checkpoint | None:
    """The store scan: the newest checkpoint of the newest earlier try that has one (tries
    ``since`` and later only)."""
    for n in range(try_number - 1, max(since, 1) - 1, -1):
        found = newest_checkpoint(folder.parent / ("try-%d" % n))
        if found is not None:
            return found
    return None


def recorded_checkpoint(state: Any, task: Any) -> Checkpoint | None:
    """What ``task_state_store`` says is the newest committed version, if it is still committed and
    lies in one of this task instance's own try folders (``task``: ``task_folder``).

    The record is a value anyone allowed to update the task instance can write (Airflow's REST API
    lets the USER role), and what it names is copied to every executor: a record that names
    anything else (another task's checkpoint, a worker's own folder) is refused, and said."""
    if state is None:
        return None
    with contextlib.suppress(Exception):
        value = state.get(STATE_KEY, None)
        if isinstance(value, dict) and isinstance(value.get("uri"), str):
            path = storage_path(value["uri"])
            try_number = _try_of(path, task)
            if try_number is None:
                log.warning("task_state_store's %s names %s, which is not in this task instance's tries (%s): "
                            "not resumed from; the store scan decides", STATE_KEY, path, task)
                return None
            version = records.load(path / VERSION_MARKER, Version)
            if version is not None:
                return Checkpoint(path, try_number, version.step, version.seq, files=version_files(version))
            if path.name == CHECKPOINTS:  # a try's final checkpoint: what its complete marker names
                found = newest_checkpoint(path.parent)
                if found is not None and found.seq is None:
                    return found
    return None


def _try_of(path: Any, task: Any) -> int | None:
    """The number of the try folder of ``task`` that holds ``path`` (``None``: none of them does)."""
    if not is_inside(path, task):
        return None
    for folder in (path, *path.parents):
        if str(folder.parent) == str(task):
            return _try_number(folder)
    return None


def record_checkpoint(state: Any, checkpoint: Checkpoint) -> None:
    """Tell ``task_state_store`` (Airflow 3.3) the newest committed checkpoint, for the next try."""
    if state is None:
        return
    state.set(STATE_KEY, {"uri": str(checkpoint.path), "try_number": checkpoint.try_number,
                          "step": checkpoint.step, "seq": checkpoint.seq, "at": time.time()})


def checkpoint_at(uri: str, *, roots: list[str]) -> Any:
    """The checkpoint folder a ``resume`` URI names: a try folder (its newest checkpoint), its
    ``checkpoints/``, a version, or any other folder. A try folder of this provider counts only
    with something committed in it.

    The folder must lie inside one of ``roots`` (the artifact root and ``[horovod]
    resume_extra_roots``): whatever it holds is copied to every executor, and the URI may come from
    an asset event's extra, which anyone allowed to create asset events writes.
    """
    path = storage_path(uri)
    if not any(is_inside(path, storage_path(root)) for root in roots):
        raise ArtifactError(
            "Cannot resume from %s: it is outside the artifact root (%s), and whatever resume names is "
            "copied to every executor. Resume from a checkpoint under the artifact root, or list its root "
            "in [horovod] resume_extra_roots." % (path, ", ".join(roots)))
    if not path.exists():
        raise ArtifactError("Cannot resume from %s: it does not exist. Check the path (a try folder, its "
                            "checkpoints/ or a version) against the artifact root %s." % (path, roots[0]))
    if _try_number(path) is not None:
        found = newest_checkpoint(path)
        if found is None:
            raise ArtifactError("Cannot resume from %s: it holds no committed checkpoint (no %s and no "
                                "committed version)." % (path, MARKER))
        return found.path
    if path.name == CHECKPOINTS and _try_number(path.parent) is not None and read_marker(path.parent) is None:
        raise ArtifactError(
            "Cannot resume from %s: its run never committed its artifacts (no %s in %s). Pick a "
            "committed try folder." % (path, MARKER, path.parent)
        )
    return path


def named_files(path: Any) -> tuple[str, ...] | None:
    """What a marker names in the checkpoint folder ``path`` (``checkpoint_at``'s): a version's files,
    or a complete try's ``checkpoints/``; ``None`` for a folder no marker of this store describes."""
    version = records.load(path / VERSION_MARKER, Version)
    if version is not None:
        return version_files(version)
    if path.name == CHECKPOINTS and _try_number(path.parent) is not None:
        found = newest_checkpoint(path.parent)
        if found is not None and found.seq is None:
            return found.files
    return None


def is_inside(path: Any, root: Any) -> bool:
    """Whether ``path`` is ``root`` or below it, in the same store through the same connection; on
    local disk after resolving links, elsewhere with no ``..`` in the path."""
    if (path.protocol, path.conn_id) != (root.protocol, root.conn_id):
        return False
    if path.protocol in LOCAL_PROTOCOLS:
        inner, outer = os.path.realpath(path.path), os.path.realpath(root.path)
    elif ".." in path.path.split("/"):
        return False
    else:
        inner, outer = "/" + path.path.strip("/"), "/" + root.path.strip("/")
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def describe_versions(folder: Any) -> list[dict[str, Any]]:
    """The committed versions of a try as the view and the XCom show them."""
    return [{**v.to_json(), "uri": str(p)} for v, p in versions(folder)]


# -- the object operations everything above is made of -------------------------------------------
def is_local(path: Any) -> bool:
    return path.protocol in LOCAL_PROTOCOLS


def _put_bytes(dest: Any, data: bytes) -> None:
    """One object in one PUT (on local disk: one file written; a reader may see it cut, never renamed)."""
    if is_local(dest):
        Path(dest.path).parent.mkdir(parents=True, exist_ok=True)
        with open(dest.path, "wb") as f:
            f.write(data)
    else:
        dest.fs.pipe_file(dest.path, data)


def _upload(local: Path, dest: Any) -> None:
    """One file: on an object store in parallel parts (``PARTS`` of ``PART_BYTES`` at most in memory)."""
    if is_local(dest):
        Path(dest.path).parent.mkdir(parents=True, exist_ok=True)
        with local.open("rb") as src, open(dest.path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    elif hasattr(dest.fs, "_call_s3") and local.stat().st_size > 2 * PART_BYTES:
        _put_parts(local, dest)
    else:
        dest.fs.put_file(str(local), dest.path, chunksize=PART_BYTES, max_concurrency=PARTS)


def _put_parts(local: Path, dest: Any) -> None:
    """A large file to S3: boto3's transfer manager (s3transfer: one multipart upload, ``PARTS``
    parts of ``PART_BYTES`` in flight, each read by its worker thread, memory bounded by the parts
    in flight) on a client made from the store's own s3fs client: the credentials, endpoint,
    region and settings that client resolved from the Airflow connection. The object exists only
    once ``CompleteMultipartUpload`` returns: a process killed before leaves no object (an
    unfinished upload the bucket's lifecycle rule removes), and a failure aborts the upload.

    Why not s3fs's own ``put_file``: it reads each batch of parts in its event loop's thread and
    waits for the whole batch before the next, and this project's measurements put it, and a
    sliding window over s3fs's client, at 1.4-2.4x boto3's ``upload_file`` on the same server
    (docs/benchmarks.md, issue 51). A store s3fs signs in its own way (anonymous, or a signer hook
    of the connection) keeps ``put_file``."""
    client, extra = _transfer_client(dest.fs)
    if client is None:
        dest.fs.put_file(str(local), dest.path, chunksize=PART_BYTES, max_concurrency=PARTS)
        return
    from boto3.s3.transfer import TransferConfig

    bucket, key, _ = dest.fs.split_path(dest.path)
    config = TransferConfig(multipart_threshold=2 * PART_BYTES + 1, multipart_chunksize=PART_BYTES,
                            max_concurrency=PARTS)
    try:
        client.upload_file(str(local), bucket, key, ExtraArgs=extra or None, Config=config)  # its threads end with it
    finally:
        client.close()
    path = "%s/%s" % (bucket, key)
    while path:  # as s3fs's put_file does: its listing cache no longer holds the truth
        dest.fs.invalidate_cache(path)
        path = dest.fs._parent(path)


_clients_lock = threading.Lock()


def _transfer_client(fs: Any) -> tuple[Any, dict[str, Any]]:
    """A boto3 S3 client with what the s3fs filesystem ``fs`` resolved (``None`` where it signs in
    a way of its own), and the extra arguments its requests carry (``s3_additional_kwargs``,
    requester pays). Frozen credentials, taken anew for each file: a refreshable source (a role)
    is asked again by the next upload."""
    try:
        from botocore import UNSIGNED
        from fsspec.asyn import sync

        s3 = sync(fs.loop, fs.set_session)  # s3fs's client (made once per filesystem)
        config = s3.meta.config
        if getattr(fs, "anon", False) or config.signature_version is UNSIGNED:
            return None, {}  # anonymous, or a signer hook of the connection (Airflow's S3V4RestSigner)
        credentials = s3._get_credentials()
        frozen = sync(fs.loop, credentials.get_frozen_credentials) if credentials is not None else None
        if frozen is None:
            return None, {}
        import boto3
    except Exception:  # noqa: BLE001 - anything unexpected in another s3fs or botocore: s3fs's own path
        return None, {}
    from boto3.s3.transfer import S3Transfer

    with _clients_lock:  # boto3 sessions are not thread-safe; the session caches the loaded service model
        session = _session[0] = _session[0] or boto3.session.Session()
        client = session.client("s3", endpoint_url=s3.meta.endpoint_url, region_name=s3.meta.region_name,
                                aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key,
                                aws_session_token=frozen.token, config=config,
                                verify=fs.client_kwargs.get("verify"))
    extra = {**fs.s3_additional_kwargs, **fs.req_kw}
    return client, {k: v for k, v in extra.items() if k in S3Transfer.ALLOWED_UPLOAD_ARGS}


_session: list[Any] = [None]


def _delete(paths: list[Any]) -> None:
    """Delete objects (absent ones are no error): one request per thousand on an object store."""
    if not paths:
        return
    if is_local(paths[0]):
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.path)
    else:
        with contextlib.suppress(FileNotFoundError):
            paths[0].fs.rm([p.path for p in paths])
