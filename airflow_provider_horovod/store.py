"""The artifact store: where a task instance's tries and checkpoint versions live, and what their
markers say. The hook, the operator and the Horovod view call it; none of them spells a path.

The layout, under the artifact root (any ``ObjectStoragePath`` URL)::

    <dag_id>/<run_id>/<task_id>[/map-<i>]/try-<n>/   a try folder: ``records.Layout``, as the engine's
                                                      artifact_dir, plus metrics.jsonl, result.pkl and
                                                      the try's marker _ARTIFACTS.json, written last

A version counts only once its marker is there, so a reader never sees half a version as
complete. A try that never wrote its final marker (its task process was killed) still offers
its committed versions. The newest checkpoint of a try is its ``checkpoints/`` when the try
ended with a complete marker, else its newest committed version.
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner import records
from airflow_provider_horovod.runner.records import (
    CHECKPOINTS,
    METRICS,
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
TRY_FOLDER = re.compile(r"^try-([1-9][0-9]{0,6})$")
log = logging.getLogger(__name__)
LOCAL_PROTOCOLS = ("file", "local", "")
STATE_KEY = "horovod_checkpoint"  # the task_state_store key of the newest committed version


# -- the layout ---------------------------------------------------------------------------------
def storage_path(uri: Any) -> Any:
    """An ``ObjectStoragePath`` for ``uri``; a plain path is a local ``file://`` path."""
    from airflow.sdk import ObjectStoragePath

    uri = str(uri)
    if "://" not in uri:
        uri = "file://" + os.path.abspath(os.path.expanduser(uri))
    return ObjectStoragePath(uri)


def task_folder(root: Any, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Any:
    """``<root>/<dag_id>/<run_id>/<task_id>[/map-<i>]``: every try of one task instance."""
    folder = storage_path(root) / dag_id / run_id / task_id
    return folder / ("map-%d" % map_index) if map_index >= 0 else folder


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
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as err:  # noqa: BLE001 - any storage error means "cannot write here"
        raise ArtifactError(
            "Cannot write Horovod artifacts under %s (%s: %s). Point artifact_root (or [horovod] "
            "artifact_root) at a location this worker can write." % (root_path, type(err).__name__, err)
        ) from err
    if (folder / MARKER).exists():
        raise ArtifactError("%s already holds a committed run; refusing to overwrite it." % folder)
    return folder


# -- the try's final marker ---------------------------------------------------------------------
def read_marker(folder: Any) -> TryMarker | None:
    """The try's final marker, or ``None`` while the try runs (or when it was killed)."""
    return Layout(folder).read_try_marker()


def _write_json_last(folder: Any, name: str, value: dict[str, Any]) -> None:
    tmp = folder / (name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    tmp.rename(folder / name)


def store_try(local_dir: str | Path, folder: Any, marker: TryMarker, *,
              extra_files: dict[str, bytes] | None = None) -> TryMarker:
    """Copy the engine's committed ``local_dir`` (and ``extra_files``) into ``folder``, then write the
    final marker last: the try's one commit point. ``marker`` is the operator's part; the stored
    files, the engine's own marker (``run``) and whether the engine had all of rank 0's hand-over
    (``complete``) are filled in here. The versions are already in the
    store (``commit_version``)."""
    local = Path(local_dir)
    run = Layout(local).read_run_marker()
    files = []
    for path in sorted(local.rglob("*")):
        rel = path.relative_to(local).as_posix()
        if path.is_dir() or any(part.startswith(".") for part in rel.split("/")) or rel.startswith(VERSIONS + "/"):
            continue  # dot-names are the engine's unfinished transfers; versions went up as committed
        if rel == RUN_MARKER:
            continue  # kept inside the try's marker
        if rel in (METRICS, RESULT, MARKER):
            continue  # the store's own files: nothing in the engine's folder replaces them
        _upload(path, folder / rel)
        files.append(rel)
    for rel, data in sorted((extra_files or {}).items()):
        (folder / rel).write_bytes(data)
        files.append(rel)
    committed = dataclasses.replace(marker, complete=run is not None and run.complete, stored_files=tuple(files),
                                    run=run, committed_at=time.time())
    _write_json_last(folder, MARKER, committed.to_json())
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


def versions(folder: Any) -> list[tuple[Version, Any]]:
    """The committed versions of a try, oldest first (a folder without its marker is not one)."""
    return Layout(folder).committed_versions()


def prune_versions(folder: Any, keep: int) -> None:
    """Remove all but the ``keep`` newest committed versions: marker first, so none is half offered."""
    for _version, path in versions(folder)[:-keep] if keep > 0 else []:
        with contextlib.suppress(Exception):
            (path / VERSION_MARKER).unlink()
            path.rmdir() if not any(path.iterdir()) else _remove_tree(path)


def _remove_tree(path: Any) -> None:
    if path.protocol in LOCAL_PROTOCOLS:
        shutil.rmtree(str(path.path), ignore_errors=True)
    else:
        path.rmdir(recursive=True)


# -- the try's metrics --------------------------------------------------------------------------
def commit_metrics(folder: Any, local: Path) -> None:
    """Replace the try's ``metrics.jsonl`` with the local file as it is now: uploaded under a
    temporary name, then renamed, so a reader sees the previous whole file or this one."""
    tmp = folder / (".%s.tmp" % METRICS)
    _upload(local, tmp)
    tmp.rename(folder / METRICS)


def read_metrics(folder: Any, *, max_rows: int) -> list[dict[str, Any]]:
    """The try's kept reports, oldest first, thinned evenly to at most ``max_rows`` (``parse_metrics``)."""
    try:
        with (folder / METRICS).open("rb") as f:
            return parse_metrics(bounded_lines(f), max_rows=max_rows)
    except Exception:  # noqa: BLE001 - absent (no report yet) or unreadable: nothing to show
        return []


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

    def describe(self) -> str:
        where = "try %s" % self.try_number if self.try_number is not None else "an earlier run"
        if self.seq is None:
            return "%s (%s, as it ended)" % (self.path, where)
        return "%s (%s, version %d%s)" % (self.path, where, self.seq,
                                          ", step %d" % self.step if self.step is not None else "")


def _try_number(folder: Any) -> int | None:
    match = TRY_FOLDER.match(folder.name or "")
    return int(match.group(1)) if match else None


def _nonempty(path: Any) -> bool:
    with contextlib.suppress(Exception):
        return path.is_dir() and any(path.iterdir())
    return False


def newest_checkpoint(folder: Any) -> Checkpoint | None:
    """The try's newest complete checkpoint: ``checkpoints/`` of a try that ended with a complete
    marker, else its newest committed version (a killed try's too)."""
    marker = read_marker(folder)
    if marker is not None and marker.complete and _nonempty(checkpoints_of(folder)):
        return Checkpoint(checkpoints_of(folder), _try_number(folder))
    committed = versions(folder)
    if committed:
        version, path = committed[-1]
        return Checkpoint(path, _try_number(folder), version.step, version.seq)
    return None


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
            marker = read_marker(path.parent)
            if (path / VERSION_MARKER).exists() or (marker is not None and marker.complete):
                return Checkpoint(path, try_number, value.get("step"), value.get("seq"))
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


def _upload(local: Path, dest: Any) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with local.open("rb") as src, dest.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
