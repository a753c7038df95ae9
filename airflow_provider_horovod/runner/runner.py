"""``HorovodRunner(np).run(main, **kwargs)``: the seed's API over one Spark barrier stage."""

from __future__ import annotations

import contextlib
import logging
import platform
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import cloudpickle

from airflow_provider_horovod.exceptions import HorovodRunError, InsufficientSlotsError, RunCancelledError
from airflow_provider_horovod.runner import procs, wire
from airflow_provider_horovod.runner.barrier import RunSpec, TaskFailure, parse_failure, run_local, run_task
from airflow_provider_horovod.runner.channel import Channel
from airflow_provider_horovod.runner.payload import build_payload, describe

log = logging.getLogger(__name__)

LAUNCHERS = ("mpirun", "gloo")
VERBOSITIES = ("all", "log_callback_only")
RESULT_SCHEMA = "partition int, kind string, seq int, data binary"
FAIL_GRACE_S = 3.0  # after a rank reports an error, how long Spark gets to fail the stage itself


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
        self.np = np
        self.launcher = launcher
        self.driver_log_verbosity = driver_log_verbosity
        self.env = env
        self.start_timeout = float(start_timeout)
        self._spark = spark
        self._cancelled = threading.Event()
        self._tag: str | None = None
        self._session: Any = None
        self.last_run: dict[str, Any] = {}

    # -- public ---------------------------------------------------------------------------------
    def run(self, main: Callable[..., Any] | str, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank and return rank 0's return value."""
        payload = build_payload(main, (), kwargs)
        self._cancelled.clear()
        run_id = uuid.uuid4().hex[:12]
        secret = wire.new_secret()
        started = time.monotonic()
        self.last_run = {"run_id": run_id, "np": self.np, "launcher": self.launcher, "events": []}
        log.info("Starting Horovod job %s: %s on %d %s with %s", run_id, describe(main), abs(self.np),
                 "barrier tasks" if self.np > 0 else "local processes", self.launcher)
        channel = Channel(secret, emit_logs=self.driver_log_verbosity == "all")
        with self._signals():
            try:
                if self.np < 0:
                    channel.start("127.0.0.1")
                    spec = self._spec(run_id, secret, payload, channel.address)
                    result = self._run_local(spec, channel)
                else:
                    result = self._run_spark(run_id, secret, payload, channel)
            finally:
                channel.close()
                self.last_run["events"] = list(channel.events)
                self.last_run["rejected_connections"] = channel.rejected
                self.last_run["duration_s"] = round(time.monotonic() - started, 3)
        self.last_run["result"] = result
        return result

    def cancel(self) -> None:
        """Interrupt the running job from any thread; every rank process goes with it."""
        self._cancelled.set()
        if self._session is not None and self._tag is not None:
            with contextlib.suppress(Exception):
                self._session.interruptTag(self._tag)

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
            start_timeout=self.start_timeout,
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
        self._wait(thread, channel, cancel=procs.kill_all)
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
        channel.expected_tasks = self.np
        spec = self._spec(run_id, secret, payload, address)
        tag = "hvdrunner-%s" % run_id
        self._session, self._tag = spark, tag
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

        def cancel() -> None:
            channel.close()  # tasks take the hang-up as cancel and stop their processes at once
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)

        try:
            self._wait(thread, channel, cancel=cancel, started_by=address is not None)
        finally:
            self._session = self._tag = None
        if "error" in box:
            raise self._spark_error(box["error"], channel) from None
        return self._collect(box["rows"], channel)

    def _wait(self, thread: threading.Thread, channel: Channel, cancel: Callable[[], Any], started_by: bool = False) -> None:
        """Wait for the job thread; fail fast on a rank error, on cancellation and on a slow start."""
        deadline = time.monotonic() + self.start_timeout
        first_error_at = None
        try:
            while thread.is_alive():
                thread.join(0.1)
                if self._cancelled.is_set():
                    cancel()
                    thread.join(30)
                    raise RunCancelledError("The Horovod job was cancelled; the Spark job was interrupted.")
                if channel.errors and first_error_at is None:
                    first_error_at = time.monotonic()
                if first_error_at is not None and time.monotonic() - first_error_at > FAIL_GRACE_S:
                    cancel()  # a rank failed and Spark has not ended the stage yet: end it
                    thread.join(30)
                    raise self._error(channel.errors[0], channel)
                if started_by and not channel.started_event.is_set() and time.monotonic() > deadline:
                    cancel()
                    thread.join(30)
                    raise InsufficientSlotsError(
                        "Only %d of %d barrier tasks started within start_timeout=%ss. The cluster has %s; "
                        "lower np or add executors." % (len(channel.started), self.np, self.start_timeout, self._slots_text())
                    )
        except KeyboardInterrupt:
            cancel()
            thread.join(30)
            raise RunCancelledError("The Horovod job was interrupted (KeyboardInterrupt); the Spark job was cancelled.") from None

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
