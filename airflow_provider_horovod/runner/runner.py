"""``HorovodRunner(np).run(main, **kwargs)``: the seed's API over one Spark barrier stage."""

from __future__ import annotations

import contextlib
import os
import logging
import platform
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_horovod.exceptions import ArtifactError, HorovodRunError, InsufficientSlotsError, RunCancelledError
from airflow_provider_horovod.runner import procs, wire
from airflow_provider_horovod.runner.barrier import RunSpec, TaskFailure, parse_failure, run_local, run_task
from airflow_provider_horovod.runner.artifacts import check_writable, commit
from airflow_provider_horovod.runner.channel import Channel
from airflow_provider_horovod.runner.payload import build_payload, describe

log = logging.getLogger(__name__)

LAUNCHERS = ("mpirun", "gloo")
VERBOSITIES = ("all", "log_callback_only")
RESULT_SCHEMA = "partition int, kind string, seq int, data binary"
STOP_GRACE_S = 20.0  # after asking the tasks to stop their ranks, how long before cutting them off
CANCEL_GRACE_S = 5.0  # the same, when the user cancelled: every process must be gone within 10 s
ARTIFACT_GRACE_S = 60.0  # how long rank 0's task gets to send its artifacts after the job ended
CANCEL_ARTIFACT_GRACE_S = 3.0


def _task_fn(spec: RunSpec) -> Callable:
    def task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        rows = run_task(BarrierTaskContext.get(), spec)
        schema = pa.schema([("partition", pa.int32()), ("kind", pa.string()), ("seq", pa.int32()), ("data", pa.binary())])
        yield pa.RecordBatch.from_pylist(rows, schema=schema)

    return task


class HorovodRunner:
    """Run a training function as a Horovod job, in one barrier-mode Spark stage.

    :param np: ``np > 0``: that many barrier tasks, one rank each. ``np < 0``: ``-np`` rank
        processes on the driver, with no Spark job (to try the training function first).
    :param launcher: ``"mpirun"`` (the default, as in the original HorovodRunner) or ``"gloo"``.
    :param driver_log_verbosity: ``"all"`` streams every rank's output into the driver's log;
        ``"log_callback_only"`` streams only ``runtime.log_to_driver`` messages.
    :param spark: the SparkSession to use; else the active one; else ``getOrCreate()``.
    :param env: extra environment variables for every rank process.
    :param start_timeout: seconds to wait for enough barrier slots and for all tasks to start.
    """

    def __init__(
        self,
        np: int,
        *,
        launcher: str = "mpirun",
        driver_log_verbosity: str = "all",
        spark: Any = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        timeline: bool = False,
        artifact_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(np, bool) or not isinstance(np, int):
            raise ValueError("np must be a non-zero int (np > 0: barrier tasks, np < 0: local processes); got %r" % (np,))
        if np == 0:
            raise ValueError("np must be non-zero: np > 0 runs np barrier tasks, np < 0 runs -np processes on the driver")
        if launcher not in LAUNCHERS:
            raise ValueError("launcher must be one of %s; got %r" % (", ".join(LAUNCHERS), launcher))
        if driver_log_verbosity not in VERBOSITIES:
            raise ValueError("driver_log_verbosity must be one of %s; got %r" % (", ".join(VERBOSITIES), driver_log_verbosity))
        env = dict(env or {})
        bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError("env must map str to str; fix %s" % ", ".join(map(repr, bad)))
        if start_timeout <= 0:
            raise ValueError("start_timeout must be positive; got %r" % (start_timeout,))
        if resume_from is not None and not Path(resume_from).is_dir():
            raise ValueError("resume_from must be an existing folder; %s is not" % (resume_from,))
        self.np = np
        self.launcher = launcher
        self.driver_log_verbosity = driver_log_verbosity
        self.env = env
        self.start_timeout = float(start_timeout)
        self.timeline = bool(timeline)
        self.artifact_dir = Path(artifact_dir) if artifact_dir is not None else None
        self.resume_from = Path(resume_from).resolve() if resume_from is not None else None
        self._spark = spark
        self._cancelled = threading.Event()
        self.last_run: dict[str, Any] = {}

    # -- public ---------------------------------------------------------------------------------
    def run(self, main: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank and return rank 0's return value."""
        payload = build_payload(main, args, kwargs)
        artifact_dir = self._artifact_dir()
        if self.timeline and artifact_dir is None:
            raise ValueError("timeline=True needs an artifact_dir to bring the timeline back to")
        self._cancelled.clear()
        run_id = uuid.uuid4().hex[:12]
        secret = wire.new_secret()
        started = time.monotonic()
        self.last_run = {"run_id": run_id, "np": self.np, "launcher": self.launcher, "events": [], "result": None,
                         "artifact_dir": str(artifact_dir) if artifact_dir else None, "timeline_path": None,
                         "checkpoint_path": None, "spark_ui_url": None, "status": "running"}
        log.info("Starting Horovod job %s: %s on %d %s with %s", run_id, describe(main), abs(self.np),
                 "barrier tasks" if self.np > 0 else "local processes", self.launcher)
        staging = artifact_dir / (".incoming-%s" % run_id) if artifact_dir else None
        channel = Channel(secret, emit_logs=self.driver_log_verbosity == "all", artifact_staging=staging,
                          resume_root=self.resume_from)
        result = None
        status = "failed"
        try:
            with self._signals():
                try:
                    if self.np < 0:
                        channel.start("127.0.0.1")
                        result = self._run_local(self._spec(run_id, secret, payload, channel.address), channel)
                    else:
                        result = self._run_spark(run_id, secret, payload, channel)
                    status = "success"
                except RunCancelledError:
                    status = "cancelled"
                    raise
                finally:
                    channel.close()
                    self.last_run["events"] = list(channel.events)
                    self.last_run["rejected_connections"] = channel.rejected
                    self.last_run["duration_s"] = round(time.monotonic() - started, 3)
                    self.last_run["status"] = status
        finally:
            if artifact_dir is not None and staging is not None:
                self._commit(artifact_dir, staging, channel, status, run_id, result)
        self.last_run["result"] = result
        return result

    def cancel(self) -> None:
        """Interrupt the running job from any thread; every rank process goes with it."""
        self._cancelled.set()

    # -- phases ---------------------------------------------------------------------------------
    def _artifact_dir(self) -> Path | None:
        if self.artifact_dir is None:
            return None
        return check_writable(self.artifact_dir)

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
            timeline=self.timeline,
            collect_artifacts=self.artifact_dir is not None,
            has_resume=self.resume_from is not None,
            resume_local=str(self.resume_from) if (self.resume_from is not None and self.np < 0) else None,
        )

    def _run_local(self, spec: RunSpec, channel: Channel) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["data"] = run_local(spec, -self.np)
            except BaseException as err:  # noqa: BLE001
                box["error"] = err

        thread = threading.Thread(target=target, name="hvdrunner-local", daemon=True)
        thread.start()
        reason = self._supervise(thread, channel, stop=procs.kill_all, hard_cancel=procs.kill_all)
        self._raise_for(reason, channel)
        if "error" in box:
            err = box["error"]
            if isinstance(err, TaskFailure):
                raise self._error(err.report, channel) from None
            raise err
        return cloudpickle.loads(box["data"])

    def session(self) -> Any:
        """The SparkSession this runner uses: the one given, else the active one, else a new one."""
        if self._spark is not None:
            return self._spark
        from pyspark.sql import SparkSession

        return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()

    def _run_spark(self, run_id: str, secret: bytes, payload: bytes, channel: Channel) -> Any:
        spark = self.session()
        self._check_conf(spark)
        self._wait_for_slots(spark)
        address = channel.start(self._driver_host(spark))
        if address is None and self.resume_from is not None:
            raise HorovodRunError("resume_from needs the executors to reach the driver, and this driver cannot listen "
                                  "for them. Put the checkpoint where the training function can read it instead.")
        channel.expected_tasks = self.np
        spec = self._spec(run_id, secret, payload, address)
        tag = "hvdrunner-%s" % run_id
        self.last_run["spark_ui_url"] = self._ui_url(spark)
        self.last_run["job_tag"] = tag
        df = spark.range(self.np, numPartitions=self.np).mapInArrow(_task_fn(spec), RESULT_SCHEMA, barrier=True)
        box: dict[str, Any] = {}

        def target() -> None:
            spark.addTag(tag)
            try:
                box["rows"] = df.collect()
            except BaseException as err:  # noqa: BLE001
                box["error"] = err
            finally:
                with contextlib.suppress(Exception):
                    spark.removeTag(tag)

        thread = threading.Thread(target=target, name="hvdrunner-job-%s" % run_id, daemon=True)
        thread.start()

        def hard_cancel() -> None:
            channel.close()  # tasks take the hang-up as cancel and stop at once
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)

        reason = self._supervise(thread, channel, stop=lambda: channel.broadcast({"t": "stop"}),
                                 hard_cancel=hard_cancel, started_by=address is not None)
        if self.artifact_dir is not None and address is not None and 0 not in channel.done:
            # Rank 0's task sends its artifacts before it ends, after a failure too: give it time.
            channel.broadcast({"t": "stop"})
            grace = CANCEL_ARTIFACT_GRACE_S if reason == "cancel" else ARTIFACT_GRACE_S
            deadline = time.monotonic() + grace
            log.info("Waiting up to %ss for rank 0's artifacts", grace)
            while 0 not in channel.done and time.monotonic() < deadline:
                time.sleep(0.05)
        hard_cancel()  # whatever is still running ends now
        self._raise_for(reason, channel)
        if "error" in box:
            raise self._spark_error(box["error"], channel) from None
        return self._collect(box["rows"], channel)

    def _supervise(self, thread: threading.Thread, channel: Channel, *, stop: Callable[[], Any],
                   hard_cancel: Callable[[], Any], started_by: bool = False) -> str | None:
        """Wait for the job thread. On a rank error, cancellation or a slow start, ask the tasks to
        stop their ranks (rank 0's task still sends its artifacts); if they do not end within
        ``STOP_GRACE_S``, cut them off. Returns why it stopped the job, or None."""
        deadline = time.monotonic() + self.start_timeout
        reason: str | None = None
        stop_sent = 0.0
        try:
            while thread.is_alive():
                thread.join(0.1)
                if reason is None:
                    if self._cancelled.is_set():
                        reason = "cancel"
                    elif channel.errors:
                        reason = "error"
                    elif started_by and not channel.started_event.is_set() and time.monotonic() > deadline:
                        reason = "timeout"
                    if reason is not None:
                        stop()
                        stop_sent = time.monotonic()
                elif time.monotonic() - stop_sent > (CANCEL_GRACE_S if reason == "cancel" else STOP_GRACE_S):
                    if (reason != "cancel" and channel.upload_started.is_set() and not channel.upload_done.is_set()
                            and time.monotonic() - stop_sent < ARTIFACT_GRACE_S):
                        continue  # rank 0's artifacts are on their way: do not cut them off
                    log.info("The barrier tasks did not end after the stop request (%s); cutting them off", reason)
                    hard_cancel()
                    thread.join(30)
        except KeyboardInterrupt:
            self._cancelled.set()
            reason = "cancel"
            stop()
            thread.join(CANCEL_GRACE_S)
            hard_cancel()
            thread.join(30)
        return reason

    def _raise_for(self, reason: str | None, channel: Channel) -> None:
        if reason == "cancel" or self._cancelled.is_set():
            raise RunCancelledError("The Horovod job was cancelled; the Spark job was interrupted.")
        if reason == "timeout":
            raise InsufficientSlotsError(
                "Only %d of %d barrier tasks started within start_timeout=%ss. The cluster has %s; "
                "lower np or add executors." % (len(channel.started), self.np, self.start_timeout, self._slots_text())
            )
        if reason == "error" and channel.errors:
            raise self._error(channel.errors[0], channel)

    def _commit(self, artifact_dir: Path, staging: Path, channel: Channel, status: str, run_id: str, result: Any) -> None:
        complete = channel.upload_done.is_set() and channel.upload_error is None
        if not channel.upload_started.is_set() and status == "success":
            complete = True  # nothing to send (no checkpoint, no timeline): an empty, complete run
            staging.mkdir(parents=True, exist_ok=True)
        try:
            info = commit(artifact_dir, staging, status=status, complete=complete, run_id=run_id,
                          received=channel.received, extra={"np": self.np, "launcher": self.launcher})
        except OSError as err:
            raise ArtifactError("Cannot commit artifacts to %s (%s)." % (artifact_dir, err), result=result) from err
        if channel.upload_error is not None and status == "success":
            raise ArtifactError("Rank 0's artifacts could not be written to %s (%s); the run itself succeeded."
                                % (artifact_dir, channel.upload_error), result=result)
        log.info("Artifacts of run %s (%s, %s): %d files in %s", run_id, status,
                 "complete" if info["complete"] else "INCOMPLETE", len(info["files"]), artifact_dir)
        self.last_run["artifacts"] = info
        self.last_run["artifact_transfer_s"] = channel.upload_seconds
        self.last_run["artifact_transport"] = channel.transport  # "copy" (same host), "stream", or None
        self.last_run["artifact_bytes"] = sum(f["size"] for f in channel.received)
        if info.get("timeline"):
            self.last_run["timeline_path"] = str(artifact_dir / info["timeline"])
            self.last_run["timeline_summary_path"] = str(artifact_dir / info["timeline_summary"])
            self.last_run["timeline_picture_path"] = str(artifact_dir / info["timeline_picture"])
        if info.get("checkpoint"):
            self.last_run["checkpoint_path"] = str(artifact_dir / info["checkpoint"])

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
                    "spark.task.cpus, and GPUs per task where set). Lower np or add executors."
                    % (self.np, self.np, self._slots, )
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
            import json

            for rank, lines in json.loads(data).items():
                channel.lines(int(rank), lines)
        result = b"".join(data for _, _, data in sorted(chunks.get("result", [])))
        if not result:
            raise HorovodRunError("Rank 0 finished but its return value did not come back.")
        return cloudpickle.loads(result)

    def _error(self, report: dict[str, Any], channel: Channel) -> HorovodRunError:
        rank = report.get("rank")
        host = report.get("host")
        where = "Rank %s on host %s (executor %s)" % (rank, host, report.get("executor")) if rank is not None else "The job"
        message = report.get("message") or "%s failed: %s" % (where, report.get("exception", "unknown error"))
        tails = {int(k): list(v) for k, v in channel.tails.items()}
        if rank is not None and report.get("tail"):
            tails[int(rank)] = list(report["tail"])
        self.last_run["error"] = report
        return HorovodRunError(message, rank=rank, host=host, remote_traceback=report.get("traceback") or None, log_tail=tails)

    def _spark_error(self, err: BaseException, channel: Channel) -> HorovodRunError:
        if self._cancelled.is_set():
            return RunCancelledError("The Horovod job was cancelled; the Spark job was interrupted.")
        if channel.errors:
            return self._error(channel.errors[0], channel)
        text = str(err)
        report = parse_failure(text)
        if report is not None:
            return self._error(report, channel)
        if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
            import re

            found = re.search(r"different version \(?([\d, .]+)\)? than that in driver ([\d.]+)", text)
            executor = found.group(1).replace(", ", ".").strip() if found else "another version"
            return HorovodRunError(
                "Python %s on the executors differs from the driver's %s. Point PYSPARK_PYTHON (or "
                "spark.pyspark.python) at the same Python version on the driver and the executors."
                % (executor, platform.python_version())
            )
        return HorovodRunError("The Spark job running the Horovod ranks failed: %s" % str(err).strip()[:4000])

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
