"""One attempt: one barrier stage, plan -> start -> supervise -> collect (``np < 0``: the driver's own
rank processes, no Spark job).

An attempt owns what lives for one stage: its secret, the channel the tasks and ranks report to, the
events and the supervisor that decides on them. The run that drives it (``runner.HorovodRunner.run``)
owns the options, the payload, the artifact folder and the versions committed so far, and commits
the end; it hands each attempt values, never itself (as Ray Train's controller hands its worker group
a context): the run's ``AttemptOptions``, how to get the SparkSession, and the run's cancel event.
The supervisor stays pure: this module carries out its actions (``act``).
"""

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_horovod.exceptions import (
    ClusterSettingsError,
    ExecutorMismatchError,
    FixedSlotsError,
    HorovodRunError,
    InsufficientSlotsError,
    RunCancelledError,
    rank_error,
)
from airflow_provider_horovod.runner import messages, names, procs, wire
from airflow_provider_horovod.runner.dataset import DatasetSpec, prepare_dataset
from airflow_provider_horovod.runner.dataset import describe as describe_dataset
from airflow_provider_horovod.runner.driver import executors
from airflow_provider_horovod.runner.driver.capacity import available_slots, can_grow, fixed_slots, worker_decommissioned
from airflow_provider_horovod.runner.driver.capacity import master_of as _master
from airflow_provider_horovod.runner.driver.channel import Channel, RankOutput
from airflow_provider_horovod.runner.driver.preemption import DecommissionWatch
from airflow_provider_horovod.runner.driver.restarts import Ending, RestartPolicy, ending_of
from airflow_provider_horovod.runner.driver.supervisor import (
    Action,
    CutOff,
    Deadlines,
    PlanError,
    Release,
    SendPlan,
    SendStart,
    Stop,
    Supervisor,
    Upload,
)
from airflow_provider_horovod.runner.environment import stack_of_this_host
from airflow_provider_horovod.runner.events import CancelRequested, Failure, JobEnded, RanksInspected, RunReport
from airflow_provider_horovod.runner.plan import LOCAL_EXECUTOR, Plan, TaskFacts, host_identity, make_plan, slot_summary
from airflow_provider_horovod.runner.exits import ERROR_MARKER, TaskFailure, parse_failure
from airflow_provider_horovod.runner.options import Launcher
from airflow_provider_horovod.runner.readiness import check_facts, shm_warnings
from airflow_provider_horovod.runner.spec import RunSpec
from airflow_provider_horovod.runner.horovod_stall import stall_in
from airflow_provider_horovod.runner.task import rank_states
from airflow_provider_horovod.runner.task.barrier import run_local
from airflow_provider_horovod.runner.text import one_line, quoted, quoted_text
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.driver.versions import VersionSink

log = logging.getLogger(__name__)

RESULT_SCHEMA = "partition int, kind string, seq int, data binary"


def _in_thread(name: str, work: Callable[[], Any], events: queue.Queue) -> threading.Thread:
    """Run ``work`` in a daemon thread; its end (value or error) becomes a ``JobEnded`` event."""

    def target() -> None:
        try:
            value = work()
        except BaseException as err:  # noqa: BLE001 - the supervisor decides what it means
            failure = err.failure if isinstance(err, TaskFailure) else parse_failure(str(err))  # np < 0: as raised
            events.put(JobEnded(error=err, failure=failure))
        else:
            events.put(JobEnded(value=value))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


@dataclasses.dataclass(frozen=True)
class AttemptOptions:
    """What an attempt reads of its run's options (``HorovodRunner``'s, as checked when it was made),
    one value a run: every attempt of the run gets the same. What changes from one attempt to the
    next (its number, its size, where it resumes from) is the attempt's own."""

    np: int  # the run's np: a restart may run on fewer (min_np, ``Attempt.np``)
    launcher: Launcher
    driver_log_verbosity: str
    env: dict[str, str]
    start_timeout: float
    stall_timeout: int
    timeline: bool
    deadlines: Deadlines
    artifact_limits: Limits
    restarts: RestartPolicy
    dataset: Any = None
    on_report: Callable[[messages.Report], None] | None = None

    @property
    def verbosity(self) -> str:
        """The run's ``driver_log_verbosity``; with ``np < 0`` always ``"all"``: local processes show every
        rank's output whatever it says, as sparkdl's HorovodRunner sends local-mode output to the cell."""
        return "all" if self.np < 0 else self.driver_log_verbosity


def checked_plan(driver_python: str, driver_stack: dict[str, str], facts: list[TaskFacts]) -> Plan:
    """The driver's planner: the plan of ``facts``, or ``PlanError`` when ``check_facts`` refuses them;
    a host that is short of something its ranks may need is a warning in the log (``readiness``)."""
    failure = check_facts(driver_python, facts, driver_stack)
    if failure is not None:
        raise PlanError(failure)
    for warning in shm_warnings(facts):
        log.warning("%s", warning)
    return make_plan(facts)


class Attempt:
    """One barrier stage of a run (see the module's docstring)."""

    def __init__(self, options: AttemptOptions, session: Callable[[], Any], cancelled: threading.Event,
                 run_id: str, payload: bytes, report: RunReport, staging: Path | None, sink: VersionSink | None, *,
                 number: int = 0, resume_from: Path | None = None, lost_at: float | None = None,
                 workers_gone: list[str] | None = None) -> None:
        self.options = options
        self.session = session  # the run's SparkSession, asked for only where the attempt runs a Spark job
        self.cancelled = cancelled  # the run's: set by a cancel, and by an exception raised into the supervising
        self.interrupt: BaseException | None = None  # that exception (not Ctrl-C): the run raises it at its end
        self.number = number  # 0, then 1, 2, ... after each restart (runtime.attempt())
        # the first attempt is the run: its id, its job tag; a restart's tasks and folders are its own
        self.run_id = run_id if number == 0 else "%s-%d" % (run_id, number)
        self.payload = payload
        self.report = report
        self.np = options.np  # a restart may run on fewer (min_np): every size below is this one
        self.resume_from = resume_from  # the run's resume_from, or the version a restart resumes from
        self.lost_at = lost_at  # when the attempt before lost its infrastructure (monotonic), for the log
        # executors whose worker Spark decommissioned (capacity.can_grow): the attempts' before, then this one's
        self.workers_gone = list(workers_gone or ())
        self.ranks_started_at: float | None = None
        self.ending: Ending | None = None
        self._job: tuple[Any, str] | None = None  # (SparkSession, tag) of the stage submitted
        self.events: queue.Queue = queue.Queue()
        self.secret = wire.new_secret()
        self.channel = Channel(self.secret, run_id=self.run_id, on_event=self.events.put, artifact_staging=staging,
                               resume_root=self.resume_from, limits=options.artifact_limits, versions=sink,
                               on_report=options.on_report, on_terminating=self._terminating,
                               output=RankOutput(stream_all=options.verbosity == "all"))
        self.supervisor: Supervisor | None = None
        self.workers_python = "python3"  # what the executors were asked to run, for the error that names it
        self.slots: int | None = None
        self.preempted_at: float | None = None  # when Spark began decommissioning an executor (monotonic)
        self.versions_at_notice = 0  # how many versions the run had committed then
        self.sink = sink
        self._watch: DecommissionWatch | None = None
        self._notice_lock = threading.Lock()

    def run(self) -> Any:
        """Plan, start, supervise and collect: rank 0's return value, or the error that says what happened."""
        spec = self._spec(self.run_id, self.secret, self.payload, None)
        start = self._run_local if self.np < 0 else self._run_spark
        self.supervisor = start(spec, self.channel, self.events)
        try:
            value = self._outcome(self.supervisor, self.channel)
        except BaseException:
            sup = self.supervisor
            self.ending = ending_of(cancelled=self.cancelled.is_set(), reason=sup.reason, cause=sup.cause,
                                    job_error=sup.job_ended.error if sup.job_ended is not None else None)
            raise
        self.ending = Ending.SUCCESS
        return value

    def cancel(self) -> None:
        """From any thread: the supervisor stops the ranks; ``run`` then raises ``RunCancelledError``."""
        self.events.put(CancelRequested())

    @property
    def upload(self) -> Upload:
        """How far rank 0's final hand-over came."""
        return self.supervisor.upload if self.supervisor is not None else Upload.NONE

    @property
    def marks(self) -> dict[str, float]:
        return dict(self.supervisor.marks) if self.supervisor is not None else {}

    @property
    def ended_at(self) -> float | None:
        """When the supervisor saw the attempt end (monotonic): its first stop, else its job's end."""
        sup = self.supervisor
        mark = None if sup is None else sup.marks.get("stop", sup.marks.get("job-ended"))
        return None if mark is None else sup.began + mark

    def close(self) -> None:
        """The attempt's end: its channel closes (a task still running takes the hang-up as a cancel
        and kills its ranks); a Spark job it submitted that has not ended is interrupted, so a
        restart never runs beside the stage before it."""
        if self._watch is not None:
            self._watch.stop()
        self.channel.close()
        if self._job is not None and (self.supervisor is None or self.supervisor.job_ended is None):
            spark, tag = self._job
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)

    # -- phases ---------------------------------------------------------------------------------
    def _spec(self, run_id: str, secret: bytes, payload: bytes, channel: tuple[str, int] | None) -> RunSpec:
        return RunSpec(
            run_id=run_id,
            secret=secret,
            payload=payload,
            launcher=self.options.launcher,
            verbosity=self.options.verbosity,
            channel=channel,
            env=self.options.env,
            driver_python=platform.python_version(),
            stall_timeout_s=self.options.stall_timeout,
            driver_stack=stack_of_this_host(horovod=self.options.launcher.runs_horovod),
            timeline=self.options.timeline,
            collect_artifacts=self.sink is not None,  # every run keeps rank 0's folder (runner.run)
            has_resume=self.resume_from is not None,
            resume_local=str(self.resume_from) if (self.resume_from is not None and self.np < 0) else None,
            attempt=self.number,
            max_restarts=self.options.restarts.max_restarts,
            preempt_grace_s=self.options.deadlines.preempt_grace_s,
        )

    def _run_local(self, spec: RunSpec, channel: Channel, events: queue.Queue) -> Supervisor:
        spec = dataclasses.replace(spec, channel=channel.start("127.0.0.1"))
        self.report.coordination = "local"
        sup = Supervisor(0, coordinated=False, planner=make_plan, deadlines=self.options.deadlines, now=time.monotonic(),
                         here=(host_identity(0), LOCAL_EXECUTOR))
        task = names.TaskDir(names.new_temp_dir(names.TASK_DIR_PREFIX % (spec.run_id, "local", os.getpid())))
        channel.expect_artifacts_from(task.path)  # the one folder the driver copies artifacts from
        _in_thread("hvdrunner-local", lambda: run_local(spec, -self.np, task), events)
        self._ranks_started()

        def act(action: Action) -> None:
            if isinstance(action, Stop):
                events.put(RanksInspected({int(r): v for r, v in rank_states.snapshot().items()}))  # before the kill
            if isinstance(action, (Stop, CutOff)):
                procs.kill_all()  # the ranks (or mpirun) this process started; rank 0's folder still goes up
            if isinstance(action, CutOff):
                channel.close()

        self._supervise(sup, events, act)
        return sup

    def _run_spark(self, spec: RunSpec, channel: Channel, events: queue.Queue) -> Supervisor:
        spark = self.session()
        self._check_conf(spark)
        if self.number > 0:
            self.np = self._slots_for_restart(spark)
        source, dataset = self._input(spark)
        self._wait_for_slots(spark)
        address = channel.start(self._driver_host(spark))
        if address is None and self.resume_from is not None:
            raise HorovodRunError("resume_from needs the executors to reach the driver, and this driver cannot listen "
                                  "for them. Put the checkpoint where the training function can read it instead.")
        spec = dataclasses.replace(spec, channel=address, dataset=dataset)
        tag = "hvdrunner-%s" % spec.run_id
        self.report.coordination = "channel" if address is not None else "spark"
        entry = executors.task_entry(pickle.dumps(spec), ERROR_MARKER, "spark_task",
                                     executors.needed_modules(self.options.launcher))
        self.workers_python = executors.workers_python(spark)
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
        sup = Supervisor(self.np, coordinated=address is not None, planner=planner, deadlines=self.options.deadlines,
                         now=time.monotonic())
        self._job = (spark, tag)
        _in_thread("hvdrunner-job-%s" % spec.run_id, collect, events)
        self._watch = DecommissionWatch(spark, self._preempting)

        def act(action: Action) -> None:
            if isinstance(action, SendPlan):
                channel.record({"kind": "plan", "slots": slot_summary(action.plan)})
                channel.expect_plan(action.plan)
                channel.send_tasks(messages.Planned(action.plan))
            elif isinstance(action, SendStart):
                channel.send_tasks(messages.Start())
                self._ranks_started()
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
        if self.options.dataset is None:
            return spark.range(self.np, numPartitions=self.np), None
        source, spec = prepare_dataset(spark, self.options.dataset, self.np)
        log.info("Dataset %s: %d rows in %d shards of %d to %d rows", describe_dataset(self.options.dataset), spec.total_rows,
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
                if not isinstance(err, KeyboardInterrupt) and self.interrupt is None:
                    self.interrupt = err
                self.cancelled.set()
                events.put(CancelRequested())

    # -- the verdict ------------------------------------------------------------------------------
    def _outcome(self, sup: Supervisor, channel: Channel) -> Any:
        """Rank 0's return value, or the error that says what happened."""
        if sup.reason == "cancel" or self.cancelled.is_set():
            raise RunCancelledError("The Horovod job was cancelled; every rank was stopped.")
        if sup.reason == "timeout":
            raise InsufficientSlotsError(
                "Only %d of %d barrier tasks started within start_timeout=%ss. The cluster has %s; "
                "lower np or add executors." % (len(sup.started), self.np, self.options.start_timeout, self._slots_text())
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

    # -- checks ---------------------------------------------------------------------------------
    def _check_conf(self, spark: Any) -> None:
        def conf(key: str, default: str = "") -> str:
            with contextlib.suppress(Exception):
                return spark.conf.get(key, default) or default
            return default

        if conf("spark.dynamicAllocation.enabled", "false").lower() == "true":
            raise ClusterSettingsError(
                "Spark dynamic allocation is enabled, and barrier stages cannot run with it. Set "
                "spark.dynamicAllocation.enabled=false for this session (or its connection's extras)."
            )

    def _wait_for_slots(self, spark: Any) -> None:
        """Until the cluster has ``np`` barrier slots (executors that register late, slots other jobs
        hold), within ``start_timeout``; the log says what it waits for and how long it took."""
        self.slots = available_slots(spark)
        if self.slots is None or self.slots >= self.np:
            return
        master = _master(spark)
        if fixed_slots(master):
            raise FixedSlotsError(
                "np=%d needs %d barrier slots, but the cluster has %d (the master %s), and no executor can join a "
                "local master: waiting start_timeout=%gs would not help. Lower np to %d or less, or give the master "
                "more cores (local[%d], in the connection's host or the session's master)." % (
                    self.np, self.np, self.slots, master, self.options.start_timeout, self.slots, self.np))
        log.info("Waiting up to start_timeout=%gs for %d barrier slots: the cluster has %d now (executors still "
                 "registering, or slots other jobs hold)", self.options.start_timeout, self.np, self.slots)
        started = time.monotonic()
        deadline = started + self.options.start_timeout
        while self.slots < self.np:
            if self.cancelled.is_set():
                raise RunCancelledError("The Horovod job was cancelled while it waited for barrier slots.")
            if time.monotonic() > deadline:
                raise InsufficientSlotsError(
                    "np=%d needs %d barrier slots, but the cluster has %d (executor cores / "
                    "spark.task.cpus, and GPUs per task where set) after waiting start_timeout=%gs. "
                    "Lower np, add executors, or raise start_timeout when other jobs hold the slots."
                    % (self.np, self.np, self.slots, self.options.start_timeout)
                )
            time.sleep(0.5)
            self.slots = available_slots(spark) or 0
        log.info("The cluster has %d barrier slots after waiting %.1f s for them", self.slots, time.monotonic() - started)

    def _slots_for_restart(self, spark: Any) -> int:
        """A restart's size, asked of the policy every half second (``RestartPolicy.restart_size``):
        ``np`` once that many slots are back; what there is once it is at least ``min_np`` and the last
        call is over, or at once where the cluster says the rest cannot come (``capacity.can_grow``);
        else ``InsufficientSlotsError``."""
        policy, began, minimum_since, told = self.options.restarts, time.monotonic(), None, False
        while True:
            slots, now = available_slots(spark), time.monotonic()
            if slots is not None and slots >= (policy.min_np or self.np):
                minimum_since = minimum_since or now
            else:
                minimum_since = None
            size = policy.restart_size(self.np, slots, waited_s=now - began, can_grow=can_grow(spark, self.workers_gone),
                                       minimum_for_s=None if minimum_since is None else now - minimum_since,
                                       start_timeout_s=self.options.start_timeout)
            if size.np is not None or size.fail:
                break
            if not told and minimum_since is not None:
                told = True
                log.info("Attempt %d: %d of np=%d barrier slots are back (min_np=%d); waiting up to last_call=%gs for "
                         "the rest", self.number, slots, self.np, policy.min_np, policy.last_call_s)
            if self.cancelled.is_set():
                self.ending = Ending.CANCELLED
                raise RunCancelledError("The Horovod job was cancelled while its restart waited for barrier slots.")
            time.sleep(0.5)
        if size.fail:
            raise InsufficientSlotsError(
                "Only %d of np=%d barrier slots are there after the loss (%s after %.0f s), fewer than min_np=%s. Add "
                "executors, or lower min_np to restart on what is left."
                % (slots or 0, self.np, size.why, now - began, policy.min_np or self.np))
        if size.np < self.np:
            log.warning("Attempt %d runs on %d of np=%d barrier tasks (min_np=%d): %s, %.1f s after it began waiting",
                        self.number, size.np, self.np, policy.min_np, size.why, now - began)
        return size.np

    def _preempting(self, executors: list[str], why: str = "Spark is decommissioning executor %s") -> None:
        """Spark is decommissioning ``executors``: every task tells its ranks (``runtime.preempting()``),
        so rank 0 can commit a version before the loss; a restart waits ``preempt_grace_s`` for it.
        The first notice of the attempt counts; a later one changes nothing."""
        with self._notice_lock:
            if self.preempted_at is not None:
                return
            self.preempted_at = time.monotonic()
        self.versions_at_notice = len(self.sink.committed) if self.sink is not None else 0
        if self._job is not None:  # asked now: the scheduler forgets the state once the executor is gone
            self.workers_gone += [e for e in executors if worker_decommissioned(self._job[0], e)]
        log.warning(why + ": every rank of attempt %d is told (runtime.preempting())", ", ".join(executors), self.number)
        self.channel.record({"kind": "preempting", "executors": executors})
        self.channel.send_tasks(messages.Preempting())

    def _terminating(self, executor: str) -> None:
        """A barrier task on ``executor`` was told to terminate (SIGTERM): the same notice."""
        self._preempting([executor], "The barrier task on executor %s was told to terminate (SIGTERM)")

    def _ranks_started(self) -> None:
        self.ranks_started_at = time.monotonic()
        if self.number > 0 and self.lost_at is not None:
            log.info("Attempt %d of run %s: its %d ranks start %.1f s after the loss that ended attempt %d",
                     self.number, self.report.run_id, abs(self.np), self.ranks_started_at - self.lost_at, self.number - 1)

    def _slots_text(self) -> str:
        return "%d slots available" % self.slots if self.slots is not None else "an unknown number of slots"

    @staticmethod
    def _driver_host(spark: Any) -> str:
        with contextlib.suppress(Exception):
            host = spark.conf.get("spark.driver.host")
            if host:
                import socket

                return socket.gethostbyname(host)
        return "127.0.0.1"

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
        if failure.stall and self.supervisor is not None and self.supervisor.stalls.verdict_at is not None:
            failure = self.supervisor.stalls.failure()  # told again with what the tasks saw of the silent ranks
        self.report.error = failure.to_json()
        err = run_error(failure, channel.tails(), others, launcher=self.options.launcher,
                        stall_timeout=self.options.stall_timeout)
        if failure.stall:  # the first line as the user reads it, with the tensors Horovod named
            self.report.error["message"] = str(err).split("\n", 1)[0]
        return err

    def _spark_error(self, err: BaseException, channel: Channel) -> HorovodRunError:
        if self.cancelled.is_set():
            return RunCancelledError("The Horovod job was cancelled; the Spark job was interrupted.")
        text = str(err)
        failure = parse_failure(text)
        if failure is not None:
            return self._error(failure, channel)
        mismatch = python_mismatch_text(text, platform.python_version())
        if mismatch is not None:
            return ExecutorMismatchError(mismatch)
        missing = executors.missing_module_text(text, self.workers_python, executors.needed_modules(self.options.launcher))
        if missing is not None:
            return ExecutorMismatchError(missing)
        return HorovodRunError("The Spark job running the Horovod ranks failed:\n%s" % quoted_text(str(err).strip()[:4000]))


def python_mismatch_text(text: str, driver: str) -> str | None:
    """Spark's error for executors whose Python differs from the driver's, in our words with the
    executor's version and host (PySpark 3: ``different version (3, 10) than that in driver 3.11``;
    PySpark 4: ``different version: 3.10 than that in driver: 3.11``); ``None`` for any other error."""
    if "PYTHON_VERSION_MISMATCH" not in text and "different version" not in text:
        return None
    found = re.search(r"different version:? \(?([\d][\d, .]*?)\)? than that in driver", text)
    executor = found.group(1).replace(", ", ".").strip() if found else "of another version"
    host = re.search(r"\(TID \d+\) \(([^ ()]+) executor ([^ ()]+)\)", text)
    where = " (host %s, executor %s)" % host.groups() if host else ""
    return ("Python %s on the executors%s differs from the driver's %s. Point PYSPARK_PYTHON (or "
            "spark.pyspark.python) at the same Python version on the driver and the executors." % (executor, where, driver))


def run_error(failure: Failure, tails: dict[int, list[str]], others: list[Failure] = (), *, launcher: str,
              stall_timeout: int) -> HorovodRunError:
    """The user's error for ``failure``: who, how it ended, its last lines, then the launcher's words
    (``tails``: every rank's last lines, as the channel has them; ``others``: the other hosts' reports)."""
    cause = failure
    if failure.rank is not None:
        failure = failure.with_tail(tails.get(failure.rank, []))
        tails[failure.rank] = list(failure.tail)
    # what came from the ranks and the launcher is escaped as streamed rank lines are (runner.text)
    message = one_line(failure.message)
    stall = stall_in([failure.tail, *(other.tail for other in others), *tails.values()])
    if stall is not None:  # Horovod's words say why the collectives broke: that comes first
        # its "Will shutdown" line may die with rank 0; either rule ends a try only after stall_timeout
        stall = dataclasses.replace(stall, waited_s=max(stall.waited_s, stall_timeout))
    if stall is not None and failure.stall:  # the driver's stall rule ended it: Horovod's words name the tensors
        message = message.replace("stalled: ", "stalled: %s; " % stall.text.removeprefix("stalled: "), 1)
    elif stall is not None:
        message = "%s\n%s" % (one_line(stall.advice(stall_timeout)), message)
    if failure.exit and failure.exit not in failure.message:
        message += " (the process %s)" % one_line(failure.exit)
    if not failure.traceback and failure.tail:
        message += "\n\nLast %d lines of rank %s:\n%s" % (len(failure.tail), failure.rank, quoted(failure.tail))
    if failure.stall:  # every rank's stacks, after the line that names who stalled
        message += "\n\n%s" % quoted_text(failure.traceback)
    if failure.launcher_output:
        message += "\n\n%s said:\n%s" % (launcher, quoted(failure.launcher_output[-40:]))
    for other in others:  # what the other hosts' daemons said, when they said anything
        if other is not cause and other.rank is None and other.launcher_output:
            message += "\n%s" % quoted(other.launcher_output[-20:])
    err = rank_error(failure.error_class, message, rank=failure.rank, host=failure.host,
                     remote_traceback=(failure.traceback or None) if not failure.stall else None, log_tail=tails)
    err.failure = failure.to_json()  # what HorovodRetryPolicy reads
    return err
