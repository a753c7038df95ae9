"""Checkpoint versions on the driver: what one version is, and how the engine commits it.

Rank 0's task ships the files of ``runtime.checkpoint_dir()`` that changed since the version
before (``shipper.py``); the driver builds the new version from those and the unchanged files of
the version before, in ``<artifact_dir>/versions/.<seq>.partial``, writes its marker
(``_VERSION.json``: step, time, size, files) and renames the folder to ``versions/<seq>``: one
atomic step, so a reader never sees half a version. Older versions are pruned to
``keep_checkpoints`` only after a newer one is committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner.hardlinks import link_or_copy
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.messages import PutVersion, Report, safe_relative
from airflow_provider_horovod.runner.options import check_keep
from airflow_provider_horovod.runner.records import VERSION_MARKER, VERSIONS, Layout, Version, version_name

log = logging.getLogger(__name__)

MARKER_TMP = ".%s.tmp" % VERSION_MARKER  # the marker is written here first, then renamed
# No file or folder of a checkpoint may take either name: a file would be the marker, a folder would
# make every version's commit fail (``Is a directory``), finding T4-7 of issue 49.
RESERVED_NAMES = frozenset({VERSION_MARKER, MARKER_TMP})


def committed(artifact_dir: Path) -> list[tuple[Version, Path]]:
    """The versions committed in ``artifact_dir``, oldest first."""
    return Layout(artifact_dir).committed_versions()


def newest(artifact_dir: Path) -> tuple[Version, Path] | None:
    found = committed(artifact_dir)
    return found[-1] if found else None


def commit_version(artifact_dir: Path, received: Path, manifest: dict[str, int], sent: list[str], *,
                   step: int | None, metrics: dict[str, Any]) -> tuple[Version, Path]:
    """Build the next version from ``received`` (the ``sent`` files) and the version before (the
    rest of ``manifest``), then commit it with one rename. ``OSError``/``ValueError`` leave the
    newest committed version as it was."""
    before = newest(artifact_dir)
    seq = before[0].seq + 1 if before else 1
    building = artifact_dir / VERSIONS / (".%s.partial" % version_name(seq))
    shutil.rmtree(building, ignore_errors=True)
    try:
        for rel, size in sorted(manifest.items()):
            target = building / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            source = received / rel if rel in sent else (before[1] / rel if before else None)
            if source is None or not source.is_file() or source.stat().st_size != size:
                raise ValueError("checkpoint file %s of version %d is missing or not %d bytes" % (rel, seq, size))
            if rel in sent:
                os.replace(source, target)
            else:  # committed versions never change: sharing the file is safe
                link_or_copy(source, target, copy=shutil.copyfile)
        version = Version(seq=seq, step=step, time=time.time(), size=sum(manifest.values()),
                          files=tuple(sorted(manifest.items())), sent=tuple(sorted(sent)), metrics=metrics)
        marker = building / MARKER_TMP  # a file of its own: never one a link shares
        marker.write_text(json.dumps(version.to_json(), indent=1))
        os.replace(marker, building / VERSION_MARKER)
        os.rename(building, Layout(artifact_dir).version(seq))
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return version, Layout(artifact_dir).version(seq)


def prune(artifact_dir: Path, keep: int) -> None:
    """All but the ``keep`` newest versions go, marker first."""
    for _version, path in committed(artifact_dir)[:-keep]:
        with contextlib.suppress(OSError):
            (path / VERSION_MARKER).unlink()
        shutil.rmtree(path, ignore_errors=True)


class VersionSink:
    """The driver's end of durable checkpoints: each version rank 0's task ships is committed in
    ``artifact_dir``, handed to ``on_commit`` (the operator puts it into the store), then older
    versions are pruned to ``keep``. One version at a time (``lock``)."""

    def __init__(self, artifact_dir: Path, *, keep: int, limits: Limits,
                 on_commit: Callable[[Version, Path], None] | None = None) -> None:
        self.artifact_dir = artifact_dir
        self.keep = check_keep(keep)
        self.limits = limits
        self.on_commit = on_commit
        self.lock = threading.Lock()
        self.committed: list[Version] = []
        self.errors: list[str] = []  # versions committed here that did not reach on_commit's store

    @property
    def staging(self) -> Path:
        return self.artifact_dir / ".incoming-version"

    def fresh_staging(self) -> Path:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        return self.staging

    def commit(self, msg: PutVersion, sent: list[str]) -> str | None:
        """Commit the version ``msg`` announced; ``None``, or why it was not committed."""
        try:
            manifest = self._manifest(msg.manifest)
            if not set(sent) <= set(manifest):
                raise ValueError("files were sent that the version does not list")
            checked = _checked(msg.step, msg.metrics)
            version, path = commit_version(self.artifact_dir, self.staging, manifest, sent,
                                           step=checked.step, metrics=dict(checked.metrics))
        except (OSError, ValueError, TypeError) as err:
            log.warning("Checkpoint version not committed in %s: %s", self.artifact_dir, err)
            return "cannot commit the checkpoint version in %s: %s" % (self.artifact_dir, err)
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
        self.committed.append(version)
        log.info("Checkpoint version %d (step %s, %d bytes; %d of %d files sent) committed in %s", version.seq,
                 version.step, version.size, len(version.sent), len(version.files), path)
        self._hand_on(version, path)
        prune(self.artifact_dir, self.keep)
        return None

    def _hand_on(self, version: Version, path: Path) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(version, path)
        except Exception as err:  # noqa: BLE001 - the run goes on; the next version tries again
            self.errors.append(str(err))
            log.error("%s", err)

    def _manifest(self, value: Any) -> dict[str, int]:
        if not isinstance(value, dict) or len(value) > self.limits.max_files:
            raise ValueError("the version's file list is not a mapping of at most %d files" % self.limits.max_files)
        manifest = {}
        for name, size in value.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError("file %r has no byte count" % (name,))
            rel = safe_relative(name)
            reserved = RESERVED_NAMES.intersection(rel.parts)
            if reserved:
                raise ValueError("the checkpoint folder holds %s, named %s: the runner keeps the names %s for a "
                                 "version's marker, as a file or a folder at any depth; rename that file or folder"
                                 % (rel.as_posix(), min(reserved), " and ".join(sorted(RESERVED_NAMES))))
            manifest[rel.as_posix()] = size
        if sum(manifest.values()) > self.limits.max_bytes:
            raise ValueError("the version is larger than %d bytes (max_artifact_bytes)" % self.limits.max_bytes)
        return manifest


def _checked(step: Any, metrics: Any) -> Report:
    """The version's step and metrics by ``runtime.report()``'s rules, as ``commit_checkpoint``
    checked them at the call (a rank that sends its own frames gets no further)."""
    if not isinstance(metrics, dict):
        raise ValueError("metrics must be a JSON object; got %r" % (type(metrics).__name__,))
    return Report.make(0.0, step, None, metrics)
