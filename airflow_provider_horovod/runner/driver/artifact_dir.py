"""The engine's ``artifact_dir`` on the driver: proven writable before anything runs, and the
run's end committed into it, the engine's marker ``_RUN.json`` (``records.RunMarker``) *last*.
A reader trusts the folder only when that marker says ``"complete": true``. The checkpoint
versions committed while the run goes on are ``versions.py``'s.

A run given no ``artifact_dir`` gets a run folder of its own under ``runs_root()`` (committed means
kept, with or without Airflow: a restart inside the run resumes from the newest version there, and
rank 0's last checkpoint outlives the run). It is kept after the run whatever its status, unless
rank 0 left nothing in it (no version, no checkpoint, no timeline): then it is removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner import records
from airflow_provider_horovod.runner.timeline import draw_timeline

log = logging.getLogger(__name__)
RUNS_ROOT_ENV = "HVDRUNNER_RUNS_DIR"  # where runs without artifact_dir keep their folders
HANDED_OVER = (records.CHECKPOINTS, records.TIMELINE)  # what of rank 0's folder comes back


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and prove a file can be written there; else ``ArtifactError``."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / (".probe-%s" % uuid.uuid4().hex)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ArtifactError(
            "Cannot write artifacts to %s (%s). Choose a folder this process can create and write." % (target, err.strerror or err)
        ) from err
    if (target / records.RUN_MARKER).exists():
        raise ArtifactError(
            "%s already holds the committed artifacts of an earlier run; give each run its own folder." % target
        )
    return target


def runs_root() -> Path:
    """Where a run without ``artifact_dir`` keeps its folder: ``$HVDRUNNER_RUNS_DIR``, else
    ``$XDG_CACHE_HOME/airflow-provider-horovod/runs``, else ``~/.cache/airflow-provider-horovod/runs``.

    The user's cache folder rather than the system's temporary one: it is the user's alone (a model
    is data), on disk rather than a RAM-backed ``/tmp``, and no reboot or ``tmpfiles`` sweep empties it
    while someone still wants the model (as Ray Train keeps ``~/ray_results``)."""
    chosen = os.environ.get(RUNS_ROOT_ENV)
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "airflow-provider-horovod" / "runs"


def new_run_folder(run_id: str, now: float | None = None) -> Path:
    """The run folder of a run without ``artifact_dir``: ``<runs_root()>/<UTC time>-<run_id>`` (sorted
    by time in a listing), created for this user alone and proven writable (``ArtifactError`` names
    the fix)."""
    root = runs_root()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ArtifactError(
            "Cannot create the folder %s where runs without artifact_dir keep their checkpoints (%s). Set %s to a "
            "folder this process can write, or pass artifact_dir=." % (root, err.strerror or err, RUNS_ROOT_ENV)
        ) from err
    return check_writable(root / ("%s-%s" % (stamp, run_id)))


def holds_something(artifact_dir: Path) -> bool:
    """Whether a committed run folder keeps anything of rank 0's (a version, a checkpoint, a timeline)."""
    checkpoints = artifact_dir / records.CHECKPOINTS
    return (bool(records.Layout(artifact_dir).committed_versions()) or (artifact_dir / records.TIMELINE).exists()
            or (checkpoints.is_dir() and any(checkpoints.iterdir())))


def commit(artifact_dir: Path, staging: Path, *, status: str, complete: bool, run_id: str,
           received: list[dict[str, Any]], np: int | None = None, launcher: str | None = None) -> records.RunMarker:
    """Move what was received into ``artifact_dir`` and write the engine's marker last.

    An incomplete transfer stays in its staging folder and the marker says ``complete: false``.
    """
    marker = records.RunMarker(status=status, complete=complete, run_id=run_id, files=tuple(received),
                               committed_at=time.time(), np=np, launcher=launcher)
    if complete:
        for entry in sorted(staging.iterdir()):
            if entry.name not in HANDED_OVER:  # rank 0 wrote beside its checkpoint folder: never over the driver's files
                log.warning("Rank 0's %s is not kept: only %s come back (save files under runtime.checkpoint_dir())",
                            entry.name, " and ".join(HANDED_OVER))
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        if (staging / records.TIMELINE).exists():
            marker = dataclasses.replace(marker, timeline=draw_timeline(staging))
        if (staging / records.CHECKPOINTS).is_dir() and any((staging / records.CHECKPOINTS).iterdir()):
            marker = dataclasses.replace(marker, checkpoint=records.CHECKPOINTS)
        for entry in sorted(staging.iterdir()):
            os.replace(entry, artifact_dir / entry.name)
        shutil.rmtree(staging, ignore_errors=True)
    else:
        marker = dataclasses.replace(marker, staging=staging.name)
    tmp = artifact_dir / (records.RUN_MARKER + ".tmp")
    tmp.write_text(json.dumps(marker.to_json(), indent=2))
    os.replace(tmp, artifact_dir / records.RUN_MARKER)
    return marker
