"""``HorovodRunner(np).run(main, **kwargs)``: the seed's API over one Spark barrier stage."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pickle
import platform
import queue
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_horovod.exceptions import (
    ArtifactError,
    HorovodRunError,
    InsufficientSlotsError,
    RunCancelledError,
    rank_error,
)
from airflow_provider_horovod.runner import executors, messages, names, procs, wire
from airflow_provider_horovod.runner.artifacts import Limits, check_writable, commit
from airflow_provider_horovod.runner.barrier import ERROR_MARKER, TaskFailure, checked_plan, parse_failure, run_local
from airflow_provider_horovod.runner.channel import Channel, RankOutput
from airflow_provider_horovod.runner.dataset import DatasetSpec, check_dataset, prepare_dataset
from airflow_provider_horovod.runner.dataset import describe as describe_dataset
from airflow_provider_horovod.runner.environment import require_training_stack, stack_of_this_host
from airflow_provider_horovod.runner.events import CancelRequested, Failure, JobEnded, RunReport, RunStatus
from airflow_provider_horovod.runner.host import RunSpec
from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.options import DEFAULT_STALL_TIMEOUT_S, DEFAULT_START_TIMEOUT_S, Launcher, check_options
from airflow_provider_horovod.runner.payload import build_payload, describe
from airflow_provider_horovod.runner.plan import make_plan, slot_summary
from airflow_provider_horovod.runner.stall import stall_in, whole_seconds
from airflow_provider_horovod.runner.versions import DEFAULT_KEEP, Version, VersionSink, check_keep
from airflow_provider_horovod.runner.versions import committed as committed_versions
from airflow_provider_horovod.runner.supervisor import (
    Action,
    CutOff,
    Deadlines,
    Release,
    SendPlan,
    SendStart,
    Stop,
    Supervisor,
    Upload,
)
from airflow_provider_horovod.runner.text import one_line, quoted, quoted_text

log = logging.getLogger(__name__)

RESULT_SCHEMA = "partition int, kind string, seq int, data binary"


def _in_thread(name: str, work: Callable[[], Any], events: queue.Queue) -> threading.Thread:
    """Run ``work`` in a daemon thread; its end (value or error) becomes a ``JobEnded`` event."""

    def target() -> None:
        try:
            value = work()
        except BaseException as err:  # noqa: BLE001 - the supervisor decides what it means
            events.put(JobEnded(error=err, failure=parse_failure(str(err))))
        else:
            events.put(JobEnded(value=value))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class HorovodRunner:
    """Run a training function as a Horovod job, in one barrier-mode Spark stage.

    :param np: ``np > 0``: that many barrier tasks, one rank each. ``np < 0``: ``-np`` rank
        processes on the driver, with no Spark job (to try the training function first).
    :param launcher: ``"mpirun"`` (the default, as in the original HorovodRunner), ``"gloo"``, or
        ``"torch"``: torch.distributed's own contract as ``torchrun`` sets it (``MASTER_ADDR``, ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so unmodified DDP, FSDP or ``accelerate`` code runs; it
        needs torch and no Horovod (``stall_timeout`` and ``timeline`` are Horovod's: not under torch).
    :param driver_log_verbosity: ``"all"`` streams every rank's output to the driver;
        ``"log_callback_only"`` streams only ``runtime.log_to_driver`` messages. The lines go to the
        ``airflow_provider_horovod.ranks`` logger when logging is configured, else to stdout.
    :param spark: the SparkSession to use; else the active one; else ``getOrCreate()``.
    :param env: extra environment variables for every rank process.
    :param start_timeout: seconds to wait for enough barrier slots and for all tasks to start.
    :param stall_timeout: seconds a collective may wait for a rank that never submits it (uneven
        batches, an exception swallowed on one rank) before Horovod shuts the job down and the run
        fails naming that rank and tensor (600 by default; whole seconds, rounded up). It sets
        Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` and ``HOROVOD_STALL_CHECK_TIME_SECONDS``.
    :param timeline: record a Horovod timeline on rank 0 and bring it back (needs ``artifact_dir``).
    :param artifact_dir: a local folder to commit rank 0's checkpoints and timeline into.
    :param resume_from: a checkpoint folder every rank sees as ``runtime.resume_dir()``.
    :param max_artifact_bytes: the most rank 0's artifacts may hold (1 TiB by default); a larger
        hand-over fails the run with ``ArtifactError`` rather than fill the driver's disk.
    :param max_artifact_files: the most files rank 0's artifacts may hold (100 000 by default).
    :param keep_checkpoints: with ``artifact_dir``, how many checkpoint versions committed during
        the run are kept in ``artifact_dir/versions/`` (2 by default; ``last_run.checkpoints``
        lists every one committed).
    :param on_checkpoint: called with each committed ``Version`` and its folder, from a thread of
        the driver, before older versions are pruned (the operator stores it there).
    :param on_report: called with each of rank 0's ``runtime.report`` calls that reached the driver
        (coalesced: at most two a second, ``runner.reports``), a ``messages.Report``, from a thread
        of the driver while the ranks run; an exception it raises is logged, never fails the run.
    :param dataset: training data for the ranks (``np > 0``): a ``pyspark.sql.DataFrame`` (classic
        or Spark Connect), a table name, a Spark SQL query, or a callable ``spark -> DataFrame``.
        It becomes the barrier stage's input in ``np`` partitions whose sizes differ by at most one
        row; each task spills its partition to a local Arrow file, which its rank reads with
        ``runtime.dataset()``. Checked on the driver before any rank starts (``DatasetError``).
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
        if dataset is not None and np < 0:
            raise ValueError("dataset= needs np > 0: the dataset reaches the ranks through the barrier stage, and "
                             "np < 0 runs no Spark job. Use np > 0 (local[N] Spark runs on this machine too).")
        if resume_from is not None and not Path(resume_from).is_dir():
            raise ValueError("resume_from must be an existing folder; %s is not" % (resume_from,))
        self.artifact_limits = Limits(max_bytes=max_artifact_bytes, max_files=max_artifact_files)
        self.keep_checkpoints = check_keep(keep_checkpoints)
        self.on_checkpoint = on_checkpoint
        self.on_report = on_report
        self.np = np
        self.launcher = Launcher(launcher)
        self.driver_log_verbosity = driver_log_verbosity
        self.env = env
        self.deadlines = Deadlines(start_s=float(start_timeout))
        self.start_timeout = self.deadlines.start_s
        self.stall_timeout = whole_seconds(stall_timeout)
        self.timeline = bool(timeline)
        self.artifact_dir = Path(artifact_dir) if artifact_dir is not None else None
        self.resume_from = Path(resume_from).resolve() if resume_from is not None else None
        self.dataset = dataset
        self._spark = spark
        self._workers_python = "python3"  # what the executors were asked to run, for the error that names it
        self._cancelled = threading.Event()
        self._interrupt: BaseException | None = None  # an exception raised into run() while supervising
        self._events: queue.Queue | None = None
        self.last_run = RunReport(run_id="", np=np, launcher=self.launcher, status=RunStatus.NOT_STARTED)

    # -- public ---------------------------------------------------------------------------------
    def run(self, main: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank and return rank 0's return value."""
        require_training_stack(self.launcher)  # before Spark starts: a light install fails here, naming the fix
        payload = build_payload(main, args, kwargs)
        artifact_dir = self.artifact_dir and check_writable(self.artifact_dir)
        if self.timeline and artifact_dir is None:
            raise ValueError("timeline=True needs an artifact_dir to bring the timeline back to")
        self._cancelled.clear()
        self._interrupt = None
        run_id = uuid.uuid4().hex[:12]
        started = time.monotonic()
        report = self.last_run = RunReport(run_id=run_id, np=self.np, launcher=self.launcher,
                                           artifact_dir=str(artifact_dir) if artifact_dir else None)
        log.info("Starting Horovod job %s: %s on %d %s with %s", run_id, describe(main), abs(self.np),
                 "barrier tasks" if self.np > 0 else "local processes", self.launcher)
        staging = artifact_dir / (".incoming-%s" % run_id) if artifact_dir else None
        events: queue.Queue = queue.Queue()
        self._events = events
        if self._cancelled.is_set():
            events.put(CancelRequested())
        secret = wire.new_secret()
        sink = VersionSink(artifact_dir, keep=self.keep_checkpoints, limits=self.artifact_limits,
                           on_commit=self.on_checkpoint) if artifact_dir else None
        channel = Channel(secret, run_id=run_id, on_event=events.put, artifact_staging=staging,
                          resume_root=self.resume_from, limits=self.artifact_limits, versions=sink,
                          on_report=self.on_report,
                          output=RankOutput(stream_all=self.driver_log_verbosity == "all"))
        sup: Supervisor | None = None
        result = None
        try:
            with self._signals():
                try:
                    run = self._run_local if self.np < 0 else self._run_spark
                    sup = run(self._spec(run_id, secret, payload, None), channel, events)
                    result = self._outcome(sup, channel)
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
                    channel.close()
                    self._events = None
                    report.events = channel.recorded()
                    report.rejected_connections = channel.rejected
                    report.duration_s = round(time.monotonic() - started, 3)
                    report.phases = dict(sup.marks) if sup is not None else {}
        finally:
            if artifact_dir is not None and staging is not None:
                upload = sup.upload if sup is not None else Upload.NONE
                self._commit(artifact_dir, staging, channel, upload, report, result, sink)
        report.result = result
        return result

    def cancel(self) -> None:
        """Interrupt the running job from any thread; every rank process goes with it."""
        self._cancelled.set()
        events = self._events
        if events is not None:
            events.put(CancelRequested())

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

    # -- phases ---------------------------------------------------------------------------------
    def _spec(self, run_id: str, secret: bytes, payload: bytes, channel: tuple[str, int] | None) -> RunSpec:
        return RunSpec(
            run_id=run_id,
            secret=secret,
            payload=payload,
            launcher=self.launcher,
            verbosity=self.driver_log_verbosity,
            channel=channel,
            env=self.env,
            driver_python=platform.python_version(),
            stall_timeout_s=self.stall_timeout,
            driver_stack=stack_of_this_host(horovod=self.launcher.runs_horovod),
            timeline=self.timeline,
            collect_artifacts=self.artifact_dir is not None,
            has_resume=self.resume_from is not None,
            resume_local=str(self.resume_from) if (self.resume_from is not None and self.np < 0) else None,
        )

    def _run_local(self, spec: RunSpec, channel: Channel, events: queue.Queue) -> Supervisor:
        spec = dataclasses.replace(spec, channel=channel.start("127.0.0.1"))
        self.last_run.coordination = "local"
        sup = Supervisor(0, coordinated=False, planner=make_plan, deadlines=self.deadlines, now=time.monotonic())
        task = names.TaskDir(names.new_temp_dir(names.TASK_DIR_PREFIX % (spec.run_id, "local", os.getpid())))
        channel.expect_artifacts_from(task.path)  # the one folder the driver copies artifacts from
        _in_thread("hvdrunner-local", lambda: run_local(spec, -self.np, task), events)

        def act(action: Action) -> None:
            if isinstance(action, (Stop, CutOff)):
                procs.kill_all()  # the ranks (or mpirun) this process started; rank 0's folder still goes up
            if isinstance(action, CutOff):
                channel.close()

        self._supervise(sup, events, act)
        return sup

    def _run_spark(self, spec: RunSpec, channel: Channel, events: queue.Queue) -> Supervisor:
        spark = self.session()
        self._check_conf(spark)
        source, dataset = self._input(spark)
        self._wait_for_slots(spark)
        address = channel.start(self._driver_host(spark))
        if address is None and self.resume_from is not None:
            raise HorovodRunError("resume_from needs the executors to reach the driver, and this driver cannot listen "
                                  "for them. Put the checkpoint where the training function can read it instead.")
        spec = dataclasses.replace(spec, channel=address, dataset=dataset)
        tag = "hvdrunner-%s" % spec.run_id
        report = self.last_run
        report.spark_ui_url, report.job_tag = self._ui_url(spark), tag
        report.coordination = "channel" if address is not None else "spark"
        entry = executors.task_entry(pickle.dumps(spec), ERROR_MARKER, "spark_task",
                                     executors.needed_modules(self.launcher.runs_horovod))
        self._workers_python = executors.workers_python(spark)
        with executors.python_of_workers(spark):
            df = source.mapInArrow(entry, RESULT_SCHEMA, barrier=True)

        def collect() -> list[Any]:
            spark.addTag(tag)
            try:
                return df.collect()
            finally:
                with contextlib.suppress(Exception):
                    spark.removeTag(tag)

        planner = functools.partial(checked_plan, spec.driver_python, spec.driver_stack)
        sup = Supervisor(self.np, coordinated=address is not None, planner=planner, deadlines=self.deadlines,
                         now=time.monotonic())
        _in_thread("hvdrunner-job-%s" % spec.run_id, collect, events)

        def act(action: Action) -> None:
            if isinstance(action, SendPlan):
                channel.record({"kind": "plan", "slots": slot_summary(action.plan)})
                channel.expect_plan(action.plan)
                channel.send_tasks(messages.Planned(action.plan))
            elif isinstance(action, SendStart):
                channel.send_tasks(messages.Start())
            elif isinstance(action, Release):
                channel.send_tasks(messages.Release())
            elif isinstance(action, Stop):
                channel.send_tasks(messages.Stop())
            elif isinstance(action, CutOff):
                log.info("The barrier tasks did not end after the stop request (%s); cutting them off", sup.reason)
                channel.close()  # tasks take the hang-up as cancel and stop at once
                with contextlib.suppress(Exception):
                    spark.interruptTag(tag)

        self._supervise(sup, events, act)
        if sup.job_ended is None:
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)
        return sup

    def _input(self, spark: Any) -> tuple[Any, DatasetSpec | None]:
        """The barrier stage's input: ``np`` rows, or the dataset in ``np`` balanced partitions."""
        if self.dataset is None:
            return spark.range(self.np, numPartitions=self.np), None
        source, spec = prepare_dataset(spark, self.dataset, self.np)
        log.info("Dataset %s: %d rows in %d shards of %d to %d rows", describe_dataset(self.dataset), spec.total_rows,
                 spec.shards, spec.shard_rows(spec.shards - 1), spec.shard_rows(0))
        return source, spec

    def _supervise(self, sup: Supervisor, events: queue.Queue, act: Callable[[Action], None]) -> None:
        """Feed the supervisor every event and the passing time; carry out what it decides.

        An exception raised into this thread meanwhile (Ctrl-C, or a signal handler's error such as
        Airflow's ``execution_timeout``) cancels the run, which still ends the usual way: ranks
        stopped, rank 0's artifacts handed over and committed. ``run()`` then re-raises it
        (``RunCancelledError`` for Ctrl-C).
        """
        while not sup.done:
            try:
                try:
                    event = events.get(timeout=sup.next_wakeup(time.monotonic()))
                except queue.Empty:
                    event = None
                actions = sup.handle(event, time.monotonic()) if event is not None else []
                actions += sup.tick(time.monotonic())
                for action in actions:
                    act(action)
            except BaseException as err:  # noqa: BLE001 - every interruption becomes a clean cancel
                if not isinstance(err, KeyboardInterrupt) and self._interrupt is None:
                    self._interrupt = err
                self._cancelled.set()
                events.put(CancelRequested())

    # -- the verdict ------------------------------------------------------------------------------
    def _outcome(self, sup: Supervisor, channel: Channel) -> Any:
        """Rank 0's return value, or the error that says what happened."""
        if sup.reason == "cancel" or self._cancelled.is_set():
            raise RunCancelledError("The Horovod job was cancelled; every rank was stopped.")
        if sup.reason == "timeout":
            raise InsufficientSlotsError(
                "Only %d of %d barrier tasks started within start_timeout=%ss. The cluster has %s; "
                "lower np or add executors." % (len(sup.started), self.np, self.start_timeout, self._slots_text())
            )
        if sup.cause is not None:
            raise self._error(sup.cause, channel, sup.failures)
        job = sup.job_ended
        if job is None:
            raise HorovodRunError("The Spark job did not return after it was cut off; see the Spark UI.")
        if job.error is not None:
            if isinstance(job.error, TaskFailure):
                raise self._error(job.error.failure, channel) from None
            raise self._spark_error(job.error, channel) from None
        if self.np < 0:
            return cloudpickle.loads(job.value)
        return self._collect(job.value, channel)

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
            info = commit(artifact_dir, staging, status=report.status, complete=complete, run_id=report.run_id,
                          received=channel.received, extra={"np": self.np, "launcher": self.launcher})
        except OSError as err:
            raise ArtifactError("Cannot commit artifacts to %s (%s)." % (artifact_dir, err), result=result) from err
        log.info("Artifacts of run %s (%s, %s): %d files in %s", report.run_id, report.status,
                 "complete" if info["complete"] else "INCOMPLETE", len(info["files"]), artifact_dir)
        report.artifacts = info
        report.artifact_transfer_s = channel.upload_seconds
        report.artifact_transport = channel.transport
        report.artifact_bytes = sum(f["size"] for f in channel.received)
        if info.get("timeline_summary"):
            report.timeline_path = str(artifact_dir / info["timeline"])
            report.timeline_summary_path = str(artifact_dir / info["timeline_summary"])
            report.timeline_picture_path = str(artifact_dir / info["timeline_picture"])
        if info.get("checkpoint"):
            report.checkpoint_path = str(artifact_dir / info["checkpoint"])
        elif committed_versions(artifact_dir):
            report.checkpoint_path = str(committed_versions(artifact_dir)[-1][1])
        if not info["complete"] and report.status == RunStatus.SUCCESS:
            raise ArtifactError("Rank 0's artifacts did not reach %s (%s); the run itself succeeded."
                                % (artifact_dir, channel.upload_error or "rank 0's task never handed them over"),
                                result=result)

    # -- checks ---------------------------------------------------------------------------------
    def _check_conf(self, spark: Any) -> None:
        def conf(key: str, default: str = "") -> str:
            with contextlib.suppress(Exception):
                return spark.conf.get(key, default) or default
            return default

        if conf("spark.dynamicAllocation.enabled", "false").lower() == "true":
            raise HorovodRunError(
                "Spark dynamic allocation is enabled, and barrier stages cannot run with it. Set "
                "spark.dynamicAllocation.enabled=false for this session (or its connection's extras)."
            )

    def _available_slots(self, spark: Any) -> int | None:
        """How many barrier tasks the cluster can run at once (classic sessions only)."""
        with contextlib.suppress(Exception):
            sc = spark.sparkContext
            jsc = sc._jsc.sc()
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            return int(jsc.maxNumConcurrentTasks(profile))
        return None

    def _wait_for_slots(self, spark: Any) -> None:
        self._slots = self._available_slots(spark)
        if self._slots is None:
            return
        deadline = time.monotonic() + self.start_timeout
        while self._slots < self.np:
            if time.monotonic() > deadline or self._cancelled.is_set():
                raise InsufficientSlotsError(
                    "np=%d needs %d barrier slots, but the cluster has %d (executor cores / "
                    "spark.task.cpus, and GPUs per task where set) after waiting start_timeout=%gs. "
                    "Lower np, add executors, or raise start_timeout when other jobs hold the slots."
                    % (self.np, self.np, self._slots, self.start_timeout)
                )
            time.sleep(0.5)
            self._slots = self._available_slots(spark) or 0

    def _slots_text(self) -> str:
        slots = getattr(self, "_slots", None)
        return "%d slots available" % slots if slots is not None else "an unknown number of slots"

    @staticmethod
    def _driver_host(spark: Any) -> str:
        with contextlib.suppress(Exception):
            host = spark.conf.get("spark.driver.host")
            if host:
                import socket

                return socket.gethostbyname(host)
        return "127.0.0.1"

    @staticmethod
    def _ui_url(spark: Any) -> str | None:
        with contextlib.suppress(Exception):
            return spark.sparkContext.uiWebUrl
        return None

    # -- results and errors ---------------------------------------------------------------------
    def _collect(self, rows: list[Any], channel: Channel) -> Any:
        chunks: dict[str, list[tuple[int, int, bytes]]] = {}
        for row in rows:
            chunks.setdefault(row["kind"], []).append((row["partition"], row["seq"], bytes(row["data"])))
        for _, _, data in sorted(chunks.get("logs", [])):
            for rank, lines in json.loads(data).items():
                channel.lines(int(rank), lines)
        result = b"".join(data for _, _, data in sorted(chunks.get("result", [])))
        if not result:
            raise HorovodRunError("Rank 0 finished but its return value did not come back.")
        return cloudpickle.loads(result)

    def _error(self, failure: Failure, channel: Channel, others: list[Failure] = ()) -> HorovodRunError:
        """The user's error for ``failure``: who, how it ended, its last lines, then the launcher's words."""
        tails, cause = channel.tails(), failure
        if failure.rank is not None:
            failure = failure.with_tail(tails.get(failure.rank, []))
            tails[failure.rank] = list(failure.tail)
        self.last_run.error = failure.to_json()
        # what came from the ranks and the launcher is escaped as streamed rank lines are (runner.text)
        message = one_line(failure.message)
        stall = stall_in([failure.tail, *(other.tail for other in others), *tails.values()])
        if stall is not None:  # Horovod's words say why the collectives broke: that comes first
            # its "Will shutdown" line may die with rank 0; Horovod shuts down only after stall_timeout
            stall = dataclasses.replace(stall, waited_s=max(stall.waited_s, self.stall_timeout))
            message = "%s\n%s" % (one_line(stall.advice(self.stall_timeout)), message)
        if failure.exit and failure.exit not in failure.message:
            message += " (the process %s)" % one_line(failure.exit)
        if not failure.traceback and failure.tail:
            message += "\n\nLast %d lines of rank %s:\n%s" % (len(failure.tail), failure.rank, quoted(failure.tail))
        if failure.launcher_output:
            message += "\n\n%s said:\n%s" % (self.launcher, quoted(failure.launcher_output[-40:]))
        for other in others:  # what the other hosts' daemons said, when they said anything
            if other is not cause and other.rank is None and other.launcher_output:
                message += "\n%s" % quoted(other.launcher_output[-20:])
        return rank_error(failure.error_class, message, rank=failure.rank, host=failure.host,
                          remote_traceback=failure.traceback or None, log_tail=tails)

    def _spark_error(self, err: BaseException, channel: Channel) -> HorovodRunError:
        if self._cancelled.is_set():
            return RunCancelledError("The Horovod job was cancelled; the Spark job was interrupted.")
        text = str(err)
        failure = parse_failure(text)
        if failure is not None:
            return self._error(failure, channel)
        if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
            found = re.search(r"different version \(?([\d, .]+)\)? than that in driver ([\d.]+)", text)
            executor = found.group(1).replace(", ", ".").strip() if found else "another version"
            return HorovodRunError(
                "Python %s on the executors differs from the driver's %s. Point PYSPARK_PYTHON (or "
                "spark.pyspark.python) at the same Python version on the driver and the executors."
                % (executor, platform.python_version())
            )
        missing = executors.missing_module_text(text, self._workers_python, executors.needed_modules(self.launcher.runs_horovod))
        if missing is not None:
            return HorovodRunError(missing)
        return HorovodRunError("The Spark job running the Horovod ranks failed:\n%s" % quoted_text(str(err).strip()[:4000]))

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
