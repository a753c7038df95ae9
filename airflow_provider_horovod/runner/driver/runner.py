"""``HorovodRunner(np).run(main, **kwargs)``: the seed's API. A run checks its input, drives its
attempts (one barrier stage each, ``attempt.py``; another after one that lost its infrastructure,
within ``max_restarts``, ``restarts.py``), keeps each checkpoint version rank 0 commits as it comes
(``versions.py``) and commits what rank 0 handed over at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import ArtifactError, HorovodRunError, RunCancelledError
from airflow_provider_horovod.runner.driver.artifact_dir import (
    RUNS_ROOT_ENV,
    check_writable,
    commit,
    holds_something,
    new_run_folder,
)
from airflow_provider_horovod.runner.hardlinks import link_or_copy
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.dataset import check_dataset
from airflow_provider_horovod.runner.driver import executors
from airflow_provider_horovod.runner.driver.attempt import Attempt, AttemptOptions
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.driver.supervisor import Deadlines, Upload
from airflow_provider_horovod.runner.environment import require_framework, require_training_stack
from airflow_provider_horovod.runner.events import AttemptRecord, Ending, RunReport, RunStatus, resumed_text
from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.driver.restarts import RestartPolicy, attempts_text
from airflow_provider_horovod.runner.options import (
    DEFAULT_KEEP,
    DEFAULT_LAST_CALL_S,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    Launcher,
    check_engine_values,
    check_keep,
    check_last_call,
    check_options,
    check_restarts,
)
from airflow_provider_horovod.runner.payload import build_payload, describe, resolve_callable, used_modules
from airflow_provider_horovod.runner.horovod_stall import whole_seconds
from airflow_provider_horovod.runner.driver.versions import VersionSink
from airflow_provider_horovod.runner.driver.versions import committed as committed_versions
from airflow_provider_horovod.runner.driver.versions import newest as newest_version
from airflow_provider_horovod.runner.records import Version
from airflow_provider_horovod.runner.text import one_line

log = logging.getLogger(__name__)


class HorovodRunner:
    """Run a training function as a Horovod job, in one barrier-mode Spark stage.

    :param np: ``np > 0``: that many barrier tasks, one rank each. ``np < 0``: ``-np`` rank
        processes on the driver, with no Spark job (to try the training function first).
    :param launcher: ``"mpirun"`` (the default, as in the original HorovodRunner), ``"gloo"``, or
        ``"torch"``: torch.distributed's own contract as ``torchrun`` sets it (``MASTER_ADDR``, ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so unmodified DDP, FSDP or ``accelerate`` code runs; it
        needs torch and no Horovod (``timeline`` is Horovod's: not under torch).
    :param driver_log_verbosity: ``"all"`` streams every rank's output to the driver;
        ``"log_callback_only"`` streams only ``runtime.log_to_driver`` messages (with ``np < 0``, every
        rank's output is shown whatever this says, as in sparkdl's local mode). The lines go to the
        ``airflow_provider_horovod.ranks`` logger when logging is configured, else to stdout.
    :param spark: the SparkSession to use; else the active one; else ``getOrCreate()``.
    :param env: extra environment variables for every rank process.
    :param start_timeout: seconds to wait for enough barrier slots and for all tasks to start.
    :param stall_timeout: seconds a try may go without any rank making progress (its main thread's
        stack moving, or ``runtime.report()``) before it fails with ``StallError``, naming the stalled
        ranks, where they are (user frame, or what the OS says of a rank that does not answer) and
        every rank's stacks; under every launcher (600 by default; whole seconds, rounded up). Under
        mpirun and Gloo it also sets Horovod's stall check, which names the tensor (``horovod_stall.stall_env``).
    :param timeline: record a Horovod timeline on rank 0 and bring it back into the run's folder.
    :param artifact_dir: a local folder to commit rank 0's checkpoints and timeline into. Without it,
        the run keeps them in a run folder of its own, ``<HVDRUNNER_RUNS_DIR>/<UTC time>-<run id>``
        (default root ``~/.cache/airflow-provider-horovod/runs``), named at the end of the run and in
        ``last_run.artifact_dir``; it is kept unless rank 0 left nothing in it.
    :param resume_from: a checkpoint folder every rank sees as ``runtime.resume_dir()``.
    :param max_artifact_bytes: the most rank 0's artifacts may hold (1 TiB by default); a larger
        hand-over fails the run with ``ArtifactError`` rather than fill the driver's disk.
    :param max_artifact_files: the most files rank 0's artifacts may hold (100 000 by default).
    :param keep_checkpoints: how many checkpoint versions committed during the run are kept in
        ``versions/`` of the run's folder (2 by default; ``last_run.checkpoints`` lists every one committed).
    :param on_checkpoint: called with each committed ``Version`` and its folder, from a thread of
        the driver, before older versions are pruned (the operator stores it there).
    :param on_report: called with each of rank 0's ``runtime.report`` calls that reached the driver
        (coalesced: at most two a second, ``runner.rank.reports``), a ``messages.Report``, from a thread
        of the driver while the ranks run; an exception it raises is logged, never fails the run.
    :param dataset: training data for the ranks (``np > 0``): a ``pyspark.sql.DataFrame`` (classic
        or Spark Connect), a table name, a Spark SQL query, or a callable ``spark -> DataFrame``.
        It becomes the barrier stage's input in ``np`` partitions whose sizes differ by at most one
        row; each task spills its partition to a local Arrow file, which its rank reads with
        ``runtime.dataset()``. Checked on the driver before any rank starts (``DatasetError``).
    :param max_restarts: how many times the run starts a new attempt (barrier stage) after one ended
        by lost infrastructure: a barrier task, executor or host lost, a rank killed by a signal from
        outside (SIGKILL, SIGTERM, SIGHUP, SIGINT). The next attempt runs in the same ``run()`` and
        SparkSession and resumes from the newest checkpoint version committed in the run's folder
        (``runtime.resume_dir()``; ``runtime.attempt()`` says which attempt it is). An exception of
        the training function, a payload, environment or dataset error never restarts. 0 by default.
    :param min_np: the fewest barrier tasks a restart runs on when fewer than ``np`` slots come back
        (``runtime.size()`` follows); ``None`` (default): ``np``, always.
    :param last_call: seconds a restart that has ``min_np`` slots waits for the rest before it runs on
        what there is (30 by default, torchrun's elastic "last call"); at once where the cluster says
        the rest cannot come (a ``local[N]`` master; a standalone worker Spark decommissioned). Below
        ``min_np`` it waits up to ``start_timeout``.
    """

    def __init__(
        self,
        np: int,
        *,
        launcher: str = Launcher.MPIRUN,
        driver_log_verbosity: str = "all",
        spark: Any = None,
        env: dict[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        timeline: bool = False,
        artifact_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        max_artifact_bytes: int = Limits.max_bytes,
        max_artifact_files: int = Limits.max_files,
        keep_checkpoints: int = DEFAULT_KEEP,
        on_checkpoint: Callable[[Version, Path], None] | None = None,
        dataset: Any = None,
        on_report: Callable[[Report], None] | None = None,
        max_restarts: int = 0,
        min_np: int | None = None,
        last_call: float = DEFAULT_LAST_CALL_S,
    ) -> None:
        if isinstance(np, bool) or not isinstance(np, int):
            raise ValueError("np must be a non-zero int (np > 0: barrier tasks, np < 0: local processes); got %r" % (np,))
        if np == 0:
            raise ValueError("np must be non-zero: np > 0 runs np barrier tasks, np < 0 runs -np processes on the driver")
        check_options(launcher=launcher, driver_log_verbosity=driver_log_verbosity, start_timeout=start_timeout,
                      max_artifact_bytes=max_artifact_bytes, max_artifact_files=max_artifact_files, timeline=timeline,
                      stall_timeout=stall_timeout)
        env = dict(env or {})
        bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError("env must map str to str; fix %s" % ", ".join(map(repr, bad)))
        check_dataset(dataset)
        check_restarts(max_restarts, min_np, np)
        check_engine_values(spark=spark, artifact_dir=artifact_dir, on_checkpoint=on_checkpoint, on_report=on_report)
        if dataset is not None and np < 0:
            raise ValueError("dataset= needs np > 0: the dataset reaches the ranks through the barrier stage, and "
                             "np < 0 runs no Spark job. Use np > 0 (local[N] Spark runs on this machine too).")
        if resume_from is not None and not Path(resume_from).is_dir():
            raise ValueError("resume_from=%s %s: give the checkpoint folder to resume from" % (
                resume_from, "is not a folder" if Path(resume_from).exists() else "does not exist"))
        self.artifact_limits = Limits(max_bytes=max_artifact_bytes, max_files=max_artifact_files)
        self.keep_checkpoints = check_keep(keep_checkpoints)
        self.on_checkpoint = on_checkpoint
        self.on_report = on_report
        self.np = np
        self.launcher = Launcher(launcher)
        self.driver_log_verbosity = driver_log_verbosity
        self.env = env
        self.stall_timeout = whole_seconds(stall_timeout)
        self.deadlines = Deadlines(start_s=float(start_timeout), stall_s=float(self.stall_timeout))
        self.start_timeout = self.deadlines.start_s
        self.timeline = bool(timeline)
        self.artifact_dir = Path(artifact_dir) if artifact_dir is not None else None
        self.resume_from = Path(resume_from).resolve() if resume_from is not None else None
        self.dataset = dataset
        self.restarts = RestartPolicy(max_restarts=max_restarts, min_np=min_np, last_call_s=check_last_call(last_call))
        self._spark = spark
        self._cancelled = threading.Event()
        self._interrupt: BaseException | None = None  # an exception raised into run() while supervising
        self._attempt: Attempt | None = None  # the barrier stage running now
        self._last: Attempt | None = None  # the newest attempt of the run: the one whose hand-over is committed
        self.last_run = RunReport(run_id="", np=np, launcher=self.launcher, status=RunStatus.NOT_STARTED)

    # -- public ---------------------------------------------------------------------------------
    def run(self, main: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank and return rank 0's return value."""
        build = require_training_stack(self.launcher)  # before Spark starts: a light install fails here, naming the fix
        payload = build_payload(main, args, kwargs)
        require_framework(build, used_modules(resolve_callable(main)).names(), describe(main))
        run_id = uuid.uuid4().hex[:12]
        # committed means kept: a run given no artifact_dir keeps its versions in a run folder of its own
        artifact_dir = check_writable(self.artifact_dir) if self.artifact_dir is not None else new_run_folder(run_id)
        self._cancelled.clear()
        self._interrupt = None
        self._last = None
        options = self.attempt_options()
        started = time.monotonic()
        report = self.last_run = RunReport(run_id=run_id, np=self.np, launcher=self.launcher,
                                           artifact_dir=str(artifact_dir))
        log.info("Starting Horovod job %s: %s on %d %s with %s", run_id, describe(main), abs(self.np),
                 "barrier tasks" if self.np > 0 else "local processes", self.launcher)
        staging = artifact_dir / (".incoming-%s" % run_id)
        sink = VersionSink(artifact_dir, keep=self.keep_checkpoints, limits=self.artifact_limits,
                           on_commit=self.on_checkpoint)
        result = None
        try:
            with self._signals():
                try:
                    result = self._attempts(options, run_id, payload, report, staging, sink, started)
                    report.status = RunStatus.SUCCESS
                except RunCancelledError:
                    report.status = RunStatus.CANCELLED
                    if self._interrupt is not None:  # e.g. Airflow's execution_timeout: the caller's own error
                        raise self._interrupt from None
                    raise
                except BaseException:
                    report.status = RunStatus.FAILED
                    raise
                finally:
                    report.duration_s = round(time.monotonic() - started, 3)
        finally:
            last = self._last
            if last is not None:
                self._commit(artifact_dir, staging, last.channel, last.upload, report, result, sink)
            shutil.rmtree(self._resume_copies(artifact_dir), ignore_errors=True)
            if self.artifact_dir is None:
                self._keep_or_remove(artifact_dir, report)
        report.result = result
        return result

    @staticmethod
    def _keep_or_remove(folder: Path, report: RunReport) -> None:
        """The end of a run folder the engine chose (no ``artifact_dir``): kept, and said where, when
        rank 0 left anything in it; else removed (``last_run.artifact_dir`` is then ``None``)."""
        if folder.is_dir() and holds_something(folder):
            say("Run %s kept its checkpoints in %s (%d version(s) committed; set artifact_dir= or %s to choose "
                "the folder)", report.run_id, folder, len(report.checkpoints), RUNS_ROOT_ENV)
            return
        shutil.rmtree(folder, ignore_errors=True)
        report.artifact_dir = None

    def attempt_options(self) -> AttemptOptions:
        """What every attempt of a run reads of this runner's options, as one value (made once a run)."""
        return AttemptOptions(np=self.np, launcher=self.launcher, driver_log_verbosity=self.driver_log_verbosity,
                              env=dict(self.env), start_timeout=self.start_timeout, stall_timeout=self.stall_timeout,
                              timeline=self.timeline, deadlines=self.deadlines, artifact_limits=self.artifact_limits,
                              restarts=self.restarts, dataset=self.dataset, on_report=self.on_report)

    def _attempts(self, options: AttemptOptions, run_id: str, payload: bytes, report: RunReport,
                  staging: Path | None, sink: VersionSink | None, started: float) -> Any:
        """Attempt after attempt until one returns rank 0's value or ends in a way no restart fixes
        (``restarts.RestartPolicy``); every attempt is in ``report.attempts`` and the task log."""
        resume: Path | None = self.resume_from  # the first attempt's; a restart's is the newest version
        resumed: dict[str, Any] | None = None
        lost_at: float | None = None
        workers_gone: list[str] = []  # executors whose worker Spark decommissioned in an attempt before (capacity.can_grow)
        for number in itertools.count():
            attempt = self._attempt = self._last = Attempt(options, self.session, self._cancelled, run_id, payload,
                                                           report, staging, sink, number=number, resume_from=resume,
                                                           lost_at=lost_at, workers_gone=workers_gone)
            if number == 0 and attempt.resume_from is not None:
                resumed = {"path": str(attempt.resume_from)}
            record = AttemptRecord(number=number, np=attempt.np, started_s=round(time.monotonic() - started, 3),
                                   resumed_from=resumed)
            report.attempts.append(record)
            if self._cancelled.is_set():
                attempt.cancel()
            try:
                return attempt.run()
            except BaseException as err:
                cause = one_line(str(err).split("\n", 1)[0]) or type(err).__name__
                if attempt.ending is None and not isinstance(err, Exception):  # execution_timeout, Ctrl-C: raised
                    attempt.ending = Ending.CANCELLED  # into the restart, outside the supervisor's loop
                record = dataclasses.replace(record, cause=cause, ending=attempt.ending or Ending.FAILED)
                if not (attempt.ending and self.restarts.restarts(attempt.ending, number)):
                    self._name_attempts(err, report, record)
                    _name_unverified(err, attempt.channel.unverified)
                    raise
                if self._cancelled.is_set():
                    raise RunCancelledError("The Horovod job was cancelled while it restarted; every rank was stopped.") from err
                lost_at = attempt.ended_at or time.monotonic()
                workers_gone = attempt.workers_gone
                self._await_preempted_version(attempt, sink)
                resume, resumed = self._resume_point(sink, number + 1)
                log.warning("Attempt %d of run %s lost its infrastructure (%s); restart %d of max_restarts=%d resumes "
                            "from %s", number, run_id, record.cause, number + 1, self.restarts.max_restarts,
                            resumed_text(resumed) if resumed else "the start: no checkpoint version was committed")
                if staging is not None:  # what rank 0 handed over at the loss: the next attempt hands over its own
                    shutil.rmtree(staging, ignore_errors=True)
            finally:
                attempt.close()
                self._attempt = None
                if self._interrupt is None:
                    self._interrupt = attempt.interrupt
                self._record(report, record, attempt, started)
        raise AssertionError("unreachable")

    def _name_attempts(self, err: BaseException, report: RunReport, record: AttemptRecord) -> None:
        """The run's error, after restarts: it also names every attempt and why it ended."""
        if len(report.attempts) < 2 or not isinstance(err, HorovodRunError) or not err.args:
            return
        err.args = ("%s\n\n%s" % (err.args[0], attempts_text([*report.attempts[:-1], record], self.restarts.max_restarts)),
                    *err.args[1:])

    @staticmethod
    def _record(report: RunReport, record: AttemptRecord, attempt: Attempt, started: float) -> None:
        """The attempt's end in the report and the task log: its record, its channel's events, its phases."""
        restart_s = record.restart_s
        if attempt.lost_at is not None and attempt.ranks_started_at is not None:
            restart_s = round(attempt.ranks_started_at - attempt.lost_at, 3)
        record = report.attempts[-1] = dataclasses.replace(
            record, ending=attempt.ending or record.ending or Ending.FAILED, np=attempt.np, restart_s=restart_s,
            duration_s=round(time.monotonic() - started - record.started_s, 3))
        report.events += attempt.channel.recorded()
        report.rejected_connections += attempt.channel.rejected
        report.phases = attempt.marks
        if len(report.attempts) > 1 or record.ending != Ending.SUCCESS:
            log.info("Run %s, %s", report.run_id, record.describe())

    def _await_preempted_version(self, attempt: Attempt, sink: VersionSink | None) -> None:
        """After a preemption notice, the version rank 0 committed for it may still be on its way:
        wait for it, ``preempt_grace_s`` from the notice at most, before resuming from the newest."""
        if attempt.preempted_at is None or sink is None:
            return
        deadline = attempt.preempted_at + self.deadlines.preempt_grace_s
        while (len(sink.committed) <= attempt.versions_at_notice and time.monotonic() < deadline
               and not self._cancelled.is_set()):
            time.sleep(0.05)
        if len(sink.committed) <= attempt.versions_at_notice:
            log.warning("No checkpoint version came within preempt_grace_s=%gs of the preemption notice; the restart "
                        "resumes from the newest one before it", self.deadlines.preempt_grace_s)

    def _resume_point(self, sink: VersionSink | None, number: int) -> tuple[Path | None, dict[str, Any] | None]:
        """Where a restart resumes: the newest version the driver committed, hard-linked into a folder
        of the restart's own (pruning may remove the version while its ranks read it); else the
        run's own ``resume_from``."""
        found = None
        if sink is not None:
            with sink.lock:  # a version being committed comes first
                found = newest_version(sink.artifact_dir)
                if found is not None:
                    copy = self._resume_copies(sink.artifact_dir) / str(number)
                    shutil.copytree(found[1], copy, copy_function=link_or_copy)  # versions are never written again
        if found is None:
            return self.resume_from, {"path": str(self.resume_from)} if self.resume_from is not None else None
        return copy, {"seq": found[0].seq, "step": found[0].step}

    @staticmethod
    def _resume_copies(artifact_dir: Path) -> Path:
        return artifact_dir / ".resume"

    def cancel(self) -> None:
        """Interrupt the running job from any thread; every rank process goes with it."""
        self._cancelled.set()
        attempt = self._attempt
        if attempt is not None:
            attempt.cancel()

    def session(self) -> Any:
        """The SparkSession this runner uses: the one given, else the active one, else a new one
        (with Spark's console progress bar off, so it never cuts through the ranks' lines; on a local
        master its executors run the driver's interpreter unless ``PYSPARK_PYTHON`` or
        ``spark.pyspark.python`` names one, see ``executors.give_driver_python``)."""
        if self._spark is not None:
            return self._spark
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            return active
        created = SparkSession.builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
        executors.give_driver_python(created)
        return created

    def _commit(self, artifact_dir: Path, staging: Path, channel: Channel, upload: Upload, report: RunReport,
                result: Any, sink: VersionSink) -> None:
        """The end of the run's commits: what rank 0 handed over last goes into ``artifact_dir``,
        marker last (each checkpoint version was committed as it came, by ``sink``)."""
        with sink.lock:  # a version still being committed comes first
            report.checkpoints = [v.to_json() for v in sink.committed]
            report.checkpoint_errors = list(sink.errors)
            shutil.rmtree(sink.staging, ignore_errors=True)  # a version cut off at the end (the hand-over has it)
        complete = upload == Upload.DONE and channel.upload_error is None
        if upload == Upload.NONE and report.status == RunStatus.SUCCESS and channel.address is None:
            complete = True  # no channel to hand anything over (Spark's fallback): an empty, complete run
            staging.mkdir(parents=True, exist_ok=True)
        try:
            marker = commit(artifact_dir, staging, status=report.status, complete=complete, run_id=report.run_id,
                            received=channel.received, np=self.np, launcher=self.launcher)
        except OSError as err:
            raise ArtifactError("Cannot commit artifacts to %s (%s)." % (artifact_dir, err), result=result) from err
        log.info("Artifacts of run %s (%s, %s): %d files in %s", report.run_id, report.status,
                 "complete" if marker.complete else "INCOMPLETE", len(marker.files), artifact_dir)
        report.artifacts = marker.to_json()
        report.artifact_transfer_s = channel.upload_seconds
        report.artifact_transport = channel.transport
        report.artifact_bytes = sum(f["size"] for f in channel.received)
        if marker.timeline.get("timeline_summary"):
            report.timeline_path = str(artifact_dir / marker.timeline["timeline"])
            report.timeline_summary_path = str(artifact_dir / marker.timeline["timeline_summary"])
            report.timeline_picture_path = str(artifact_dir / marker.timeline["timeline_picture"])
        if marker.checkpoint:
            report.checkpoint_path = str(artifact_dir / marker.checkpoint)
        elif committed_versions(artifact_dir):
            report.checkpoint_path = str(committed_versions(artifact_dir)[-1][1])
        if not marker.complete and report.status == RunStatus.SUCCESS:
            raise ArtifactError("Rank 0's artifacts did not reach %s (%s); the run itself succeeded."
                                % (artifact_dir, channel.upload_error or "rank 0's task never handed them over"),
                                result=result)

    @contextlib.contextmanager
    def _signals(self):
        """SIGTERM during ``run()`` cancels the job, then goes to whatever handled it before."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            self.cancel()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def say(message: str, *args: Any) -> None:
    """A line the user must see at the end of a run: the log when it shows this module's INFO lines
    (Airflow's task log, ``logging.basicConfig(level=logging.INFO)``), else stdout (a notebook, a script)."""
    if log.hasHandlers() and log.isEnabledFor(logging.INFO):
        log.info(message, *args)
    else:
        print(message % args, flush=True)


def _name_unverified(err: BaseException, unverified: list[str]) -> None:
    """The run's error also says when the driver's channel refused frames of keyed peers: something
    between the executors and the driver altered, replayed, reordered or cut them."""
    if not unverified or not isinstance(err, HorovodRunError) or not err.args:
        return
    err.args = ("%s\n\nThe driver's channel refused %d frame(s) from this run's own processes: %s. Something "
                "between the executors and the driver changed the traffic (see docs/security.md)."
                % (err.args[0], len(unverified), unverified[-1]), *err.args[1:])
