"""One Airflow try's life in the artifact store, owned by one object (as Ray Train's ``StorageContext``
owns every path of a run and its checkpoint manager what was reported): the try folder, the
checkpoint the try resumes from, the sink of checkpoint versions (background uploads, each recorded
in ``task_state_store``), the metrics recorder, the drain of the last upload, the try's final store
and the recorded final checkpoint.

The operator opens a ``TryRecorder`` before Spark starts, hands its sinks to the engine, and has
it record what the run left::

    this_try = TryRecorder.open(context, settings, hook=hook, log=log)  # the folder, the resume source
    with this_try.staging():                                           # local folders for the run (the resume copy ends with them)
        on_checkpoint, on_report = this_try.sinks(tracking)
        result, report, error = ...                                    # the engine's run
        xcom, status = this_try.record(result, report, error)          # drained, explained, stored
    this_try.record_final_checkpoint()

``store.py`` spells every path and marker; this module decides only what this try does with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_horovod import retry, store
from airflow_provider_horovod.exceptions import HorovodRunError
from airflow_provider_horovod.metrics import DEFAULT_PROGRESS_INTERVAL_S, MetricsRecorder, check_progress_interval
from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.events import Failure, RunReport, RunStatus
from airflow_provider_horovod.runner.options import DEFAULT_KEEP, Launcher

if TYPE_CHECKING:
    import logging

    from airflow.sdk import Context, ObjectStoragePath

    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

RESUME_AUTO = "auto"
RESUME_NEVER = "never"
# How long the try's end waits for the last checkpoint upload before its final marker says it did not make it
UPLOAD_DRAIN_S = 300.0


@dataclasses.dataclass(frozen=True)
class TrySettings:
    """The operator's arguments (as rendered) that decide a try's life in the store."""

    artifact_root: str | None = None
    resume: str | None = RESUME_AUTO
    resume_on_clear: bool = False
    retries: int | None = 0
    keep_checkpoints: int = DEFAULT_KEEP
    launcher: str = Launcher.MPIRUN.value
    progress_interval: float | None = None
    retry_policy: Any = None


class TryRecorder:
    """This try in the store: made by ``open`` (the try folder, the resume source), then ``staging``
    for the run (the engine's artifact folder and the recorder's scratch), ``sinks`` for the engine's
    callbacks, ``record`` when the run ended and ``record_final_checkpoint`` once the store is done.

    :param folder: the try folder (``store.prepare_try``), created and proven writable.
    :param context: the task's Airflow context (``ti``, and ``task_state_store`` where Airflow has one).
    :param settings: the operator's arguments that decide the try's life in the store.
    :param hook: the hook that resolves artifact roots and downloads a checkpoint.
    :param log: the operator's logger: every line goes to the task log as it always did.
    """

    def __init__(self, folder: ObjectStoragePath, context: Context, settings: TrySettings, *,
                 hook: HorovodRunnerHook, log: logging.Logger) -> None:
        self.folder = folder
        self.context = context
        self.settings = settings
        self.hook = hook
        self.log = log
        self.source: store.Checkpoint | None = None  # the checkpoint this try resumes from (None: from scratch)
        self.resume_from: str | None = None  # its local copy, handed to the engine
        self.local: str | None = None  # the engine's artifact folder, while staging
        self._scratch: str | None = None
        self._tracking: Any = None
        self._metrics: MetricsRecorder | None = None
        self._uploads: store.VersionUploads | None = None

    @property
    def try_number(self) -> int:
        return self.context["ti"].try_number

    # -- open: before Spark starts ---------------------------------------------------------------
    @classmethod
    def open(cls, context: Context, settings: TrySettings, *, hook: HorovodRunnerHook,
             log: logging.Logger) -> TryRecorder:
        """The try's folder, created and proven writable, and the checkpoint it resumes from, copied
        to a local folder (``resume_from``)."""
        recorder = cls(try_folder(context, settings.artifact_root, hook=hook, log=log), context, settings,
                       hook=hook, log=log)
        recorder.source, recorder.resume_from = recorder.resume_source()
        return recorder

    def resume_source(self) -> tuple[store.Checkpoint | None, str | None]:
        """The checkpoint to resume from (``None``: from scratch) and its local copy: with ``resume="auto"``
        on a retry, what ``task_state_store`` recorded, else the newest checkpoint the store scan
        finds; with a ``resume`` URI, that checkpoint."""
        resume, try_number = self.settings.resume, self.try_number
        if resume in (None, "", RESUME_NEVER):
            return None, None
        if resume == RESUME_AUTO:
            source, since = None, self.resume_since()
            if try_number > since:
                recorded = store.recorded_checkpoint(state_store(self.context), self.folder.parent)
                if recorded is not None and (recorded.try_number or 0) < since:
                    recorded = None  # made before the Clear (Airflow 3.3 keeps the state store on Clear)
                source = recorded or store.latest_checkpoint(self.folder, try_number, since)
            if source is None:
                if try_number > since:
                    self.log.info("No committed checkpoint in earlier tries: starting from scratch.")
                return None, None
        else:
            roots = self.hook.resume_roots(self.settings.artifact_root)
            path = store.checkpoint_at(str(resume), roots=roots)
            source = store.Checkpoint(path, None, files=store.named_files(path))
        self.log.info("Resuming from checkpoint %s", source.describe())
        names.sweep_orphans()  # the copies a killed try on this machine left
        return source, self.hook.download(source.path, prefix=names.RESUME_DIR_PREFIX % os.getpid(), files=source.files)

    def resume_since(self) -> int:
        """The earliest try whose checkpoints this try may resume from: 1, or with
        ``resume_on_clear=False`` the first try since the task instance was last cleared."""
        first = first_try_since_clear(self.context["ti"], self.settings.retries)
        if first > 1 and not self.settings.resume_on_clear:
            if self.try_number == first:
                self.log.info("Try %d follows a Clear of the task: starting from scratch (resume_on_clear=False). "
                              "Set resume_on_clear=True to resume from the earlier tries' checkpoints.", first)
            return first
        return 1

    # -- while the run goes on -------------------------------------------------------------------
    @contextlib.contextmanager
    def staging(self) -> Iterator[str]:
        """The engine's artifact folder (``local``, yielded) and the recorder's scratch (metrics,
        staged uploads), both removed when the try's store is done, and the resume copy with them
        (the engine has read it by then; nothing after the run reads it). Each is named after this
        process: a try killed here (SIGKILL, OOM) leaves them to the next try on this machine, which
        removes them (``names.sweep_orphans``). Left without ``record`` (the run
        raised what the try does not store), the upload thread is told to end, without waiting: what
        it held is in its ``not_stored``, and no thread uploads from a removed folder afterwards."""
        names.sweep_orphans()  # what a killed try on this machine left (its staged versions can be large)
        owned = names.STAGING_DIR_PREFIX % os.getpid()
        with tempfile.TemporaryDirectory(prefix=owned) as local, tempfile.TemporaryDirectory(prefix=owned) as scratch:
            self.local, self._scratch = local, scratch
            try:
                yield local
            finally:
                if self._uploads is not None and not self._uploads.closed:
                    self._uploads.close(0)
                self.local = self._scratch = None
                if self.resume_from is not None:
                    shutil.rmtree(self.resume_from, ignore_errors=True)
                    self.resume_from = None

    def sinks(self, tracking: Any = None) -> tuple[store.VersionUploads, MetricsRecorder]:
        """The engine's ``on_checkpoint`` (the version sink) and ``on_report`` (the metrics recorder),
        made inside ``staging``; ``tracking``: the try's MLflow run, if any, also fed every report."""
        self._tracking = tracking
        self._metrics = self.metrics_recorder(Path(self._scratch), tracking)
        self._uploads = self.version_sink(Path(self._scratch, "uploads"))
        return self._uploads, self._metrics

    def version_sink(self, staging: Path) -> store.VersionUploads:
        """What the engine calls with each checkpoint version it committed in its local staging
        (``offer``: returns at once): uploaded to the store in the background (a slow store keeps only
        the newest version waiting), then recorded in ``task_state_store`` for the next try."""
        state, try_number = state_store(self.context), self.try_number

        def stored(version: Any, path: Any) -> None:
            self.log.info("Committed checkpoint version %d (step %s, %d bytes) to %s", version.seq, version.step,
                          version.size, path)
            try:
                store.record_checkpoint(state, store.Checkpoint(path, try_number, version.step, version.seq))
            except Exception as err:  # noqa: BLE001 - the store scan still finds it
                self.log.warning("Could not record checkpoint version %d in task_state_store: %s", version.seq, err)

        return store.VersionUploads(self.folder, staging, keep=self.settings.keep_checkpoints, on_stored=stored,
                                    on_error=self.log.error)

    def metrics_recorder(self, scratch: Path, tracking: Any = None) -> MetricsRecorder:
        """What the engine calls with rank 0's reports: ``metrics.jsonl`` (committed to the store
        every few seconds), the progress line and the try's MLflow run, if any."""
        from airflow.sdk import conf

        interval = self.settings.progress_interval or check_progress_interval(
            conf.getfloat("horovod", "progress_interval", fallback=DEFAULT_PROGRESS_INTERVAL_S))
        metrics_log = store.MetricsLog(self.folder)
        return MetricsRecorder(Path(scratch, store.METRICS), commit=metrics_log.append,
                               log=self.log, progress_interval=interval, listeners=(tracking,) if tracking else ())

    # -- the run ended ---------------------------------------------------------------------------
    def record(self, result: Any, report: RunReport,
               error: BaseException | None) -> tuple[dict[str, Any], store.TryStatus]:
        """The run ended (inside ``staging``): the metrics' last commit, the last upload drained, the
        MLflow run finished, the failure explained, the try stored with its final marker; the try's
        XCom values (``metrics`` included) and status."""
        metrics, status = self._metrics.close(), try_status(report, error)
        not_stored = self.drain(self._uploads)
        if self._tracking is not None:
            self._tracking.finish(status.value, {"checkpoint": report.checkpoint_path,
                                                 "timeline": report.timeline_path}, report.attempts_json())
        failure = self.explain_failure(error, report)
        xcom = self.store_try(self.local, result, report, status, failure, not_stored)
        xcom["metrics"] = metrics
        return xcom, status

    def drain(self, uploads: store.VersionUploads) -> list[dict[str, Any]]:
        """The try ended: wait (bounded) for the last version's upload; what did not make it is logged
        and goes into the try's marker."""
        not_stored = uploads.close(UPLOAD_DRAIN_S)
        for item in not_stored:
            self.log.warning("Checkpoint version %s was not stored in %s: %s", item["seq"], self.folder, item["reason"])
        return not_stored

    def explain_failure(self, error: BaseException | None, report: RunReport) -> dict[str, Any] | None:
        """The failure the try's marker keeps (``None``: the try succeeded), with what the retry
        policy makes of it (``retry``), also logged; a ``HorovodRunError`` carries the engine's report
        (``failure``) to the policy."""
        if error is None:
            return None
        record = failure_record(error, report)
        if isinstance(error, HorovodRunError) and error.failure is None:
            error.failure = dict(record)
        if isinstance(self.settings.retry_policy, retry.HorovodRetryPolicy):
            record["retry"] = retry.judge(error).text(self.settings.retry_policy)
            self.log.error("%s", record["retry"])
        return record

    def store_try(self, local: str, result: Any, report: RunReport, status: store.TryStatus,
                  failure: dict[str, Any] | None, not_stored: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """The engine's committed ``local`` folder copied into the try folder, a result that is not
        JSON beside it, and the try's final marker last; the try's XCom values (all but ``metrics``)."""
        import cloudpickle

        xcom_result: Any = None
        extra_files: dict[str, bytes] = {}
        if failure is None:
            if is_json(result):
                xcom_result = result
            else:  # stored beside the artifacts, never written into the engine's committed folder
                extra_files[store.RESULT_FILE] = cloudpickle.dumps(result)
                xcom_result = {"artifact_uri": str(self.folder / store.RESULT_FILE), "type": _type_name(result),
                               "format": "cloudpickle"}
        resumed_from, launcher = self.source, Launcher(self.settings.launcher).value
        marker = store.TryMarker(
            status=status, complete=False, try_number=self.try_number, np=report.np, run_id=report.run_id,
            launcher=launcher, duration_s=report.duration_s,
            resumed_from=str(resumed_from.path) if resumed_from is not None else None,
            resumed_from_try=resumed_from.try_number if resumed_from is not None else None,
            resumed_from_step=resumed_from.step if resumed_from is not None else None,
            error=failure, attempts=tuple(report.attempts_json()), not_stored=tuple(not_stored),
        )
        committed = store.store_try(local, self.folder, marker, extra_files=extra_files)
        newest = store.newest_checkpoint(self.folder)
        timeline_uri = str(self.folder / store.TIMELINE) if store.TIMELINE in committed.stored_files else None
        self.log.info("Stored %d artifact files in %s (%s)", len(committed.stored_files), self.folder, status.value)
        return {
            "result": xcom_result,
            "artifacts_uri": str(self.folder),
            "checkpoint_uri": str(newest.path) if newest is not None else None,
            "timeline_uri": timeline_uri,
            "np": report.np,
            "launcher": launcher,
            "try_number": self.try_number,
            "duration_s": report.duration_s,
            "attempts": report.attempts_json(),
        }

    def record_final_checkpoint(self) -> None:
        """A try that ended with its ``checkpoints/`` stored: that is newer than its last version."""
        newest = store.newest_checkpoint(self.folder)
        if newest is None or newest.seq is not None:
            return
        try:
            store.record_checkpoint(state_store(self.context), newest)
        except Exception as err:  # noqa: BLE001 - the store scan still finds it
            self.log.warning("Could not record the try's checkpoint in task_state_store: %s", err)


def try_folder(context: Context, artifact_root: str | None, *, hook: HorovodRunnerHook,
               log: logging.Logger) -> ObjectStoragePath:
    """The try's folder under ``artifact_root``, created and proven writable (``store.prepare_try``)."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", -1)
    root = hook.artifact_root(artifact_root)
    hook.check_artifact_root(root)  # a malformed root, a missing file system or connection: named before Spark starts
    folder = store.prepare_try(
        root, dag_id=ti.dag_id, run_id=ti.run_id,
        task_id=ti.task_id, try_number=ti.try_number, map_index=map_index if isinstance(map_index, int) else -1,
    )
    log.info("Artifacts of this try go to %s", folder)
    return folder


def state_store(context: Context) -> Any:
    """Airflow 3.3's ``task_state_store`` of this task instance, where this Airflow has one."""
    state = context.get("task_state_store")
    return state if callable(getattr(state, "get", None)) and callable(getattr(state, "set", None)) else None


def first_try_since_clear(ti: Any, retries: int | None) -> int:
    """The first try number since the task instance was created or last cleared. A Clear sets
    ``max_tries`` to the try number so far plus ``retries`` (Airflow's ``clear_task_instances``), so
    the first try of the current round is ``max_tries - retries + 1``, as Airflow's own
    ``get_first_reschedule_date`` computes it. 1 when ``max_tries`` is not known."""
    max_tries, try_number = getattr(ti, "max_tries", None), getattr(ti, "try_number", 1)
    if not isinstance(max_tries, int) or isinstance(max_tries, bool) or max_tries < 0:
        return 1
    first = max_tries - (retries or 0) + 1
    return first if 1 <= first <= try_number else 1


def try_status(report: RunReport, error: BaseException | None) -> store.TryStatus:
    """How the try ended, worked out once: a run that succeeded but whose artifacts did not come
    back (``ArtifactError``) is a failed try."""
    if error is None:
        return store.TryStatus.SUCCESS
    return store.TryStatus.CANCELLED if report.status == RunStatus.CANCELLED else store.TryStatus.FAILED


def failure_record(error: BaseException, report: RunReport) -> dict[str, Any]:
    """The failure a try's marker keeps for the Horovod view, one record (``events.Failure``) as
    JSON: the engine's report, else one made from the exception."""
    if report.error and report.error.get("message"):
        return dict(report.error)
    first_line = str(error).split("\n", 1)[0]
    return Failure(
        message=first_line, exception="%s: %s" % (type(error).__name__, first_line),
        rank=getattr(error, "rank", None), host=getattr(error, "host", None),
        traceback=getattr(error, "remote_traceback", None) or "",
        tail=tuple([line for lines in (getattr(error, "log_tail", None) or {}).values() for line in lines][-40:]),
    ).to_json()


def is_json(value: Any) -> bool:
    """Whether ``value`` goes into XCom as it is (JSON, no NaN)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _type_name(value: Any) -> str:
    cls = type(value)
    return "%s.%s" % (cls.__module__, cls.__qualname__)
