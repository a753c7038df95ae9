"""The task side: what each Spark barrier task runs, in named phases (report, plan, prepare, start,
run, finish): the base environment of the host's processes, the keys handed to the ranks, handing
rank 0's artifacts and result back. What a task serves and starts for its launcher is the launcher's
(``runner/launchers/``, with what they share in ``launchers/processes.py``); the run's spec is
``runner/spec.py``; how a rank's exit reads and how a failure crosses Spark is ``runner/exits.py``;
the facts check is ``runner/readiness.py``; the rank process itself is ``runner/rank/worker.py``.

The driver coordinates the phases over its channel (``ChannelCoordinator``): no Spark
``allGather``/``barrier`` (which poll once a second) sits on the critical path. Only when the
executors cannot reach the driver does Spark's ``allGather`` coordinate them (``SparkCoordinator``).
The launcher's ``start_local`` runs the ranks on the driver for ``np < 0`` (``run_local``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import socket
import time
import traceback
from collections.abc import Iterable
from typing import Any

from airflow_provider_horovod.runner import messages, names, procs, wire
from airflow_provider_horovod.runner.transfer import fetch_resume
from airflow_provider_horovod.runner.client import ChannelClient
from airflow_provider_horovod.runner.dataset import spill
from airflow_provider_horovod.runner.environment import stack_of_this_host
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.exits import TaskFailure, rank_tails
from airflow_provider_horovod.runner.launchers import Services, launcher_of, warm_modules
from airflow_provider_horovod.runner.launchers.processes import hand_over_key, start_warm, stop_warm
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.network import LOOPBACK, Endpoint, endpoint_of, task_endpoint
from airflow_provider_horovod.runner.plan import LOCAL_EXECUTOR, Plan, Slot, TaskFacts, make_plan
from airflow_provider_horovod.runner.rank.keras_guard import LEGACY_KERAS_ENV
from airflow_provider_horovod.runner.readiness import check_facts, shm_of_this_host
from airflow_provider_horovod.runner.spec import RunSpec
from airflow_provider_horovod.runner.task import rank_states
from airflow_provider_horovod.runner.task.shipper import ship_checkpoints
from airflow_provider_horovod.runner.task.termination import SigtermNotice, announce

log = logging.getLogger(__name__)


def base_env(spec: RunSpec, task: TaskDir) -> dict[str, str]:
    """The environment of every process this host starts for the run (values never reach a shell).
    It holds no key: ranks and the rsh agent read theirs from a private file (``hand_over_key``).
    Of the task's own environment only what ``names.passes_to_ranks`` allows reaches it (PATH,
    locale, CUDA_*, NCCL_*, what the frameworks read; never a name that holds a secret); the
    user's ``env=`` is passed as given.

    The launcher adds its own (``host_env``: under mpirun, what ``horovodrun --mpi`` sets and
    Horovod's stall check; an orted passes its environment to its ranks); the user's ``env=`` may
    still set any of it otherwise. A rank's own contract comes from its launcher's ``slot_env``.
    """
    env = names.children_env()
    env.update(launcher_of(spec.launcher).host_env(spec))
    env.update(spec.env)
    # Keras 2 (tf-keras) for horovod.tensorflow.keras; TensorFlow reads it at its first import
    env.setdefault(LEGACY_KERAS_ENV, "1")  # the user's own value (driver, executor or env=) wins
    env.update(
        {
            names.ENV_PLAN: str(task.plan),
            names.ENV_PAYLOAD: str(task.payload),
            names.ENV_CHANNEL: "%s:%d" % spec.channel if spec.channel else "",
            names.ENV_VERBOSITY: spec.verbosity,
            names.ENV_TIMELINE: "1" if spec.timeline else "0",
            names.ENV_HAS_RESUME: "1" if spec.has_resume and not spec.resume_local else "0",
            names.ENV_ATTEMPT: str(spec.attempt),
            names.ENV_STALL_TIMEOUT: str(spec.stall_timeout_s),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if spec.resume_local:
        env[names.ENV_RESUME_DIR] = spec.resume_local
    return env


def hand_over_rank_keys(spec: RunSpec, slots: list[Slot]) -> None:
    """Each rank's own channel key (its logs and failure report only, as that rank) beside its task."""
    for slot in slots:
        hand_over_key(TaskDir(slot.task_dir).rank_key(slot.rank), wire.role_key(spec.secret, wire.rank_role(slot.rank)))


def missing_programs(spec: RunSpec) -> tuple[str, ...]:
    """Programs ``spec``'s launcher needs that the PATH of its ranks lacks."""
    return launcher_of(spec.launcher).missing_programs(spec.env.get("PATH", os.environ.get("PATH", "")))


def upload_artifacts(spec: RunSpec, task: TaskDir) -> Failure | None:
    """Hand rank 0's artifacts (checkpoints, timeline) to the driver; bounded. A hand-over that
    fails is the run's failure (returned, never raised): a run must not end as a success with a
    complete, empty marker while its checkpoint stayed behind.

    The driver copies them itself when it can prove it sees this folder (same host), otherwise
    they are streamed over the channel.
    """
    from airflow_provider_horovod.runner.transfer import RefusedError, upload_tree

    if not spec.collect_artifacts or spec.channel is None:
        return None
    try:
        upload_tree(spec.channel, spec.secret, task.artifacts, task.path)
    except RefusedError:
        return None  # the driver refused them and recorded why: its verdict names it (with the result)
    except (OSError, ValueError) as err:
        return Failure(message="Rank 0's artifacts (checkpoints, timeline) did not reach the driver at %s:%d: %s"
                       % (spec.channel[0], spec.channel[1], err or type(err).__name__), rank=0,
                       exception="%s: %s" % (type(err).__name__, err))
    return None


def discarded_checkpoints(spec: RunSpec, task: TaskDir) -> str | None:
    """The warning for a run without ``artifact_dir`` whose rank 0 saved checkpoints: what is thrown
    away with the task's folder (``None`` when nothing is)."""
    folder = task.artifacts / names.CHECKPOINTS_DIR
    if spec.collect_artifacts or not folder.is_dir():
        return None
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    if not files:
        return None
    shown = ", ".join(files[:5]) + (", ... (%d files)" % len(files) if len(files) > 5 else "")
    return ("WARNING: rank 0 saved %s in runtime.checkpoint_dir(), and this run has no artifact_dir: they are deleted "
            "with the task's folder now. Pass artifact_dir= to HorovodRunner to keep them (the operator always does)."
            % shown)


def result_rows(partition: int, kind: str, data: bytes, chunk: int) -> list[dict[str, Any]]:
    return [
        {"partition": partition, "kind": kind, "seq": i, "data": data[off : off + chunk]}
        for i, off in enumerate(range(0, max(len(data), 1), chunk))
    ]


RESULT_CHUNK = 4 * 1024 * 1024
# Without the driver's channel, the run's error is the stage's first task failure: a task whose rank only
# saw Horovod shut down under it (Failure.secondary) raises this much later than the peer that caused it
SECONDARY_FAILURE_DELAY_S = 1.0

__all__ = ["run_local", "run_task", "spark_task"]


class Stopped(Exception):
    """The driver said stop before the ranks started."""


def unreachable_driver(channel: tuple[str, int], partition: int, executor: str, error: str | None) -> Failure:
    """The driver listens, but this task cannot connect to it: say where, and what to open."""
    return Failure(
        "The barrier task of partition %d on executor %s cannot reach the driver's channel at %s:%d (%s). The "
        "executors must be able to open TCP connections to the driver's address (spark.driver.host) on the port "
        "the run picks (any unprivileged port, as for spark.driver.port and spark.driver.blockManager.port): allow "
        "them in the firewall in front of the driver, or set spark.driver.host to an address the executors can reach."
        % (partition, executor, channel[0], channel[1], error or "no connection"), executor=executor)


def abort_task(task: TaskDir) -> None:
    """The driver hung up mid-run (cancelled, or gone): remove the task's folder (its keys and
    payload) at once, stop every process of this task, then end the task's Python worker itself, as
    Spark would after its kill timeout. Spark may kill it meanwhile: its janitor finishes the job."""
    shutil.rmtree(task.path, ignore_errors=True)
    procs.kill_all()
    shutil.rmtree(task.path, ignore_errors=True)
    os._exit(1)


class ChannelCoordinator:
    """The phases agreed with the driver over its channel: milliseconds each."""

    name = "channel"

    def __init__(self, client: ChannelClient, partition: int) -> None:
        self.client = client
        self.partition = partition

    def plan(self, facts: TaskFacts, spec: RunSpec) -> Plan:
        self.client.send(messages.Facts(facts))
        msg = self.client.wait_for(messages.Planned)
        if not isinstance(msg, messages.Planned):
            raise Stopped()
        return msg.plan

    def ready(self, plan: Plan, spec: RunSpec) -> None:
        self.client.send(messages.Ready(self.partition))
        if isinstance(self.client.wait_for(messages.Start), messages.Stop):
            raise Stopped()

    def finish(self, failure: Failure | None, tails: dict[str, list[str]]) -> None:
        """Report the ranks' end; wait until the driver releases every task (it holds the exec
        services of the other hosts until mpirun is done)."""
        self.client.send(messages.Finished(self.partition, tails, failure))
        while not isinstance(self.client.wait_for(messages.Release), messages.Release):
            pass


class SparkCoordinator:
    """The fallback when the executors cannot reach the driver: Spark's own ``allGather``/``barrier``."""

    name = "spark"

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def plan(self, facts: TaskFacts, spec: RunSpec) -> Plan:
        gathered = [TaskFacts.from_json(m) for m in self.ctx.allGather(facts.to_json())]
        failure = check_facts(spec.driver_python, gathered, spec.driver_stack)
        if failure is not None:
            raise TaskFailure(failure)
        return make_plan(gathered)

    def ready(self, plan: Plan, spec: RunSpec) -> None:
        # every host has resume_from, its ranks' keys and its exec service the plan; the rendezvous knows it
        self.ctx.barrier()

    def finish(self, failure: Failure | None, tails: dict[str, list[str]]) -> None:
        if failure is not None:
            if failure.secondary:  # Horovod shut down under this rank because a peer failed: Spark
                time.sleep(SECONDARY_FAILURE_DELAY_S)  # reports the stage's first task failure, the peer's first
            raise TaskFailure(failure)
        self.ctx.barrier()  # every task keeps its exec service until all ranks are done


def task_facts(ctx, spec: RunSpec, partition: int, executor: str, endpoint: Endpoint, task: TaskDir,
               services: Services) -> TaskFacts:
    resources = ctx.resources()
    return TaskFacts(
        partition=partition, executor=executor, address=endpoint.address, pid=os.getpid(), task_dir=str(task.path),
        python=platform.python_version(), gpus=tuple(resources["gpu"].addresses) if "gpu" in resources else (),
        iface=endpoint.iface, network=endpoint.network, missing=missing_programs(spec), **services.ports(),
        **stack_of_this_host(), machine=socket.gethostname(), **dict(zip(("shm_size", "shm_free"), shm_of_this_host())),
    )


def prepare(spec: RunSpec, plan: Plan, partition: int, task: TaskDir, services: Services,
            batches: Iterable[Any] = ()) -> None:
    """Before any rank starts: the plan on disk, this task's partition of the dataset spilled for its
    rank, resume_from on this host, the launcher's services told the plan."""
    task.plan.write_text(plan.to_json())
    if spec.dataset is not None:
        spill(batches, task.dataset, spec.dataset, partition)
    slot = plan.for_partition(partition)
    hand_over_rank_keys(spec, [s for s in plan.slots if s.partition == partition])
    if spec.has_resume and plan.host_leader(slot.hostname).partition == partition:
        fetch_resume(spec.channel, spec.secret, task.resume, partition)  # over the channel: the engine refuses resume_from without one
    services.expect(plan, partition)


def run_task(ctx, spec: RunSpec, batches: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """The whole life of one barrier task. Returns the rows it contributes to the stage's result.
    ``batches``: the task's input partition (the dataset's, spilled in ``prepare``)."""
    partition = ctx.partitionId()
    executor = ctx.getTaskInfos()[partition].address
    names.sweep_orphans()
    janitor = procs.start_janitor()  # Spark may SIGKILL this worker: its folder and keys still go at once
    task = TaskDir(names.new_temp_dir(names.TASK_DIR_PREFIX % (spec.run_id, "p%d" % partition, os.getpid())))
    def stop() -> None:  # the driver said stop: say what the OS sees of the ranks (a stall's forensics), then kill
        rank_states.report(client, partition)
        procs.kill_all()

    client = ChannelClient(spec.channel, wire.Credentials.of(spec.secret, wire.ROLE_TASK), on_lost=lambda: abort_task(task),
                           on_stop=stop, on_preempting=lambda: announce(task.path))
    if spec.channel is not None and not client.connected:
        shutil.rmtree(task.path, ignore_errors=True)
        procs.stop_janitor(janitor)
        raise TaskFailure(unreachable_driver(spec.channel, partition, executor, client.connect_error))
    coordinator = ChannelCoordinator(client, partition) if client.connected else SparkCoordinator(ctx)
    endpoint = task_endpoint(client.source_address, executor)  # one rule for Gloo and mpirun
    client.send(messages.Hello(partition, executor))
    services = warm = None
    terminating = SigtermNotice(client, task.path, partition, executor, spec.preempt_grace_s)
    try:
        env = base_env(spec, task)
        launcher = launcher_of(spec.launcher)
        # first: its imports overlap the plan and the launch (this executor's share of the stage: its local size)
        local_size = sum(1 for info in ctx.getTaskInfos() if info.address == executor)
        warm = start_warm(task, {**env, **launcher.warm_env(spec, env, local_size)}, warm_modules(spec.launcher, spec.payload))
        task.payload.write_bytes(spec.payload)
        services = launcher.serve(spec, partition, executor, endpoint.address, task, env, client)
        plan: Plan | None = None
        failure: Failure | None = None
        try:
            plan = coordinator.plan(task_facts(ctx, spec, partition, executor, endpoint, task, services), spec)
            prepare(spec, plan, partition, task, services, batches)
            coordinator.ready(plan, spec)
            with ship_checkpoints(spec, task, rank0=partition == 0,
                                  say=lambda text: client.send(messages.Logs(0, [text], callback=True))):
                failure = launcher.start(spec, plan, partition, task, env, services, client)
        except Stopped:
            pass
        except Exception as err:  # noqa: BLE001 - with the channel, the driver hears it as this task's report
            if not client.connected:
                raise
            failure = err.failure if isinstance(err, TaskFailure) else Failure(
                "The barrier task of partition %d (executor %s) failed: %s: %s" % (partition, executor, type(err).__name__, err),
                executor=executor, exception="%s: %s" % (type(err).__name__, err), traceback=traceback.format_exc())
        mine = [s for s in plan.slots if s.partition == partition] if plan else []
        if any(s.rank == 0 for s in mine):
            uploaded = upload_artifacts(spec, task)  # after a failure too: the last good checkpoint matters
            failure = failure or uploaded
            note = discarded_checkpoints(spec, task)
            if note and client.connected:
                client.send(messages.Logs(0, [note], callback=True))
        failed = failure is not None or client.stopped.is_set()
        coordinator.finish(failure, rank_tails(mine) if failed else {})
        rows: list[dict[str, Any]] = []
        if any(s.rank == 0 for s in mine) and task.result.exists():
            rows += result_rows(partition, "result", task.result.read_bytes(), RESULT_CHUNK)
        if not client.connected:
            rows += result_rows(partition, "logs", json.dumps(rank_tails(mine)).encode(), RESULT_CHUNK)
        return rows
    finally:
        stop_warm(warm)
        if services is not None:
            services.close()
        client.close()
        shutil.rmtree(task.path, ignore_errors=True)
        procs.stop_janitor(janitor)
        terminating.close()


def spark_task(spec: bytes, batches: Iterable[Any]) -> Iterable[Any]:
    """The barrier stage's function once ``executors.task_entry`` found its imports: run the task
    (``spec``: the pickled ``RunSpec``) and yield its rows as one Arrow batch."""
    import pickle

    import pyarrow as pa
    from pyspark import BarrierTaskContext

    rows = run_task(BarrierTaskContext.get(), pickle.loads(spec), batches)
    for _ in batches:  # what the task did not read (no dataset=, or it stopped before the spill)
        pass
    schema = pa.schema([("partition", pa.int32()), ("kind", pa.string()), ("seq", pa.int32()), ("data", pa.binary())])
    yield pa.RecordBatch.from_pylist(rows, schema=schema)


def run_local(spec: RunSpec, np: int, task: TaskDir) -> bytes:
    """``np < 0``: ``np`` rank processes on the driver, no Spark job, in the folder ``task`` (removed
    at the end). Returns rank 0's pickled result."""
    janitor = procs.start_janitor()  # the driver killed (SIGKILL): the folder and keys still go at once
    try:
        missing = missing_programs(spec)
        if missing:
            raise TaskFailure(Failure("%s not found on the driver's PATH. Install Open MPI (apt-get install "
                                      "openmpi-bin) or use launcher='gloo'." % " and ".join(missing)))
        here = endpoint_of(LOOPBACK)
        facts = [TaskFacts(partition=i, executor=LOCAL_EXECUTOR, address=here.address, pid=os.getpid(), task_dir=str(task.path),
                           python=platform.python_version(), iface=here.iface, network=here.network) for i in range(np)]
        plan = make_plan(facts)
        task.plan.write_text(plan.to_json())
        task.payload.write_bytes(spec.payload)
        hand_over_rank_keys(spec, list(plan.slots))
        env = base_env(spec, task)
        launcher = launcher_of(spec.launcher)
        warm = start_warm(task, {**env, **launcher.warm_env(spec, env, np)}, warm_modules(spec.launcher, spec.payload),
                          keep=False)
        try:
            with ship_checkpoints(spec, task, rank0=True):
                failure = launcher.start_local(spec, plan, task, env)
        finally:
            stop_warm(warm)
        uploaded = upload_artifacts(spec, task)
        failure = failure or uploaded
        note = discarded_checkpoints(spec, task)
        if note:
            log.warning("%s", note)
        if failure is not None:
            raise TaskFailure(failure.with_tail(rank_tails([s for s in plan.slots if s.rank == failure.rank]).get(str(failure.rank), [])))
        return task.result.read_bytes()
    finally:
        shutil.rmtree(task.path, ignore_errors=True)
        procs.stop_janitor(janitor)
