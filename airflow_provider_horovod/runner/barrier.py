"""What each Spark barrier task runs, in named phases: report, plan, prepare, start, run, finish.
What the task serves and starts for its launcher is the launcher's (``launchers/``).

The driver coordinates the phases over its channel (``ChannelCoordinator``): no Spark
``allGather``/``barrier`` (which poll once a second) sits on the critical path. Only when the
executors cannot reach the driver does Spark's ``allGather`` coordinate them (``SparkCoordinator``).
The launcher's ``start_local`` runs the ranks on the driver for ``np < 0`` (``run_local``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import traceback
from collections.abc import Iterable
from typing import Any

from airflow_provider_horovod.exceptions import ExecutorMismatchError
from airflow_provider_horovod.runner import messages, names, procs, wire
from airflow_provider_horovod.runner.artifacts import fetch_resume
from airflow_provider_horovod.runner.channel import ChannelClient
from airflow_provider_horovod.runner.dataset import spill
from airflow_provider_horovod.runner.environment import stack_differences, stack_of_this_host
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.host import (
    RunSpec,
    base_env,
    hand_over_rank_keys,
    missing_programs,
    rank_tails,
    result_rows,
    upload_artifacts,
)
from airflow_provider_horovod.runner.launchers import Services, launcher_of
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.network import LOOPBACK, Endpoint, endpoint_of, task_endpoint
from airflow_provider_horovod.runner.plan import Plan, TaskFacts, make_plan
from airflow_provider_horovod.runner.shipper import ship_checkpoints
from airflow_provider_horovod.runner.supervisor import PlanError

ERROR_MARKER = "@@HVDRUNNER-ERROR@@"
RESULT_CHUNK = 4 * 1024 * 1024

__all__ = ["RunSpec", "TaskFailure", "check_facts", "checked_plan", "parse_failure", "run_local", "run_task", "spark_task"]


class TaskFailure(RuntimeError):
    """Raised in a barrier task (Spark fallback) or the local thread; carries the failure as JSON."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__("%s\n%s%s%s" % (failure.message, ERROR_MARKER, json.dumps(failure.to_json()), ERROR_MARKER))


class Stopped(Exception):
    """The driver said stop before the ranks started."""


def parse_failure(text: str) -> Failure | None:
    """The failure inside an exception text that travelled through Spark, if there is one."""
    start = text.find(ERROR_MARKER)
    end = text.find(ERROR_MARKER, start + len(ERROR_MARKER)) if start >= 0 else -1
    if end < 0:
        return None
    with contextlib.suppress(ValueError, TypeError):
        return Failure.from_json(json.loads(text[start + len(ERROR_MARKER) : end]))
    return None


def check_facts(driver_python: str, facts: list[TaskFacts], driver_stack: dict[str, str] | None = None) -> Failure | None:
    """Why an executor cannot run the job, in words that say what to fix; None when all can.
    ``driver_stack``: the driver's ``environment.stack_of_this_host()``, which every executor's must equal."""
    driver_mm = ".".join(driver_python.split(".")[:2])
    for f in facts:
        differences = stack_differences(driver_stack or {}, f.stack)
        if differences:
            return Failure("The executor %s (partition %d) runs another environment than the driver: %s. Give the "
                           "executors the driver's environment (a packed virtualenv in spark.archives, or the same "
                           "image; see docs/how-to.md)." % (f.executor, f.partition, "; ".join(differences)),
                           executor=f.executor, error_class=ExecutorMismatchError.__name__)
        if ".".join(f.python.split(".")[:2]) != driver_mm:
            return Failure("Python %s on executor %s differs from the driver's %s. Point PYSPARK_PYTHON at the "
                           "same Python version on the driver and the executors." % (f.python, f.executor, driver_python),
                           executor=f.executor)
        if f.missing:
            return Failure("%s not found on executor %s (PATH of the task). Install Open MPI on every executor "
                           "(apt-get install openmpi-bin), or use launcher='gloo'." % (" and ".join(f.missing), f.executor),
                           executor=f.executor)
    return None


def checked_plan(driver_python: str, driver_stack: dict[str, str], facts: list[TaskFacts]) -> Plan:
    """The driver's planner: the plan of ``facts``, or ``PlanError`` when ``check_facts`` refuses them."""
    failure = check_facts(driver_python, facts, driver_stack)
    if failure is not None:
        raise PlanError(failure)
    return make_plan(facts)


def unreachable_driver(channel: tuple[str, int], partition: int, executor: str, error: str | None) -> Failure:
    """The driver listens, but this task cannot connect to it: say where, and what to open."""
    return Failure(
        "The barrier task of partition %d on executor %s cannot reach the driver's channel at %s:%d (%s). The "
        "executors must be able to open TCP connections to the driver's address (spark.driver.host) on the port "
        "the run picks (any unprivileged port, as for spark.driver.port and spark.driver.blockManager.port): allow "
        "them in the firewall in front of the driver, or set spark.driver.host to an address the executors can reach."
        % (partition, executor, channel[0], channel[1], error or "no connection"), executor=executor)


def abort_task(task: TaskDir) -> None:
    """The driver hung up mid-run (cancelled, or gone): stop every process of this task, remove its
    folder, then end the task's Python worker itself, as Spark would after its kill timeout."""
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
            raise TaskFailure(failure)
        self.ctx.barrier()  # every task keeps its exec service until all ranks are done


def task_facts(ctx, spec: RunSpec, partition: int, executor: str, endpoint: Endpoint, task: TaskDir,
               services: Services) -> TaskFacts:
    resources = ctx.resources()
    return TaskFacts(
        partition=partition, executor=executor, address=endpoint.address, pid=os.getpid(), task_dir=str(task.path),
        python=platform.python_version(), gpus=tuple(resources["gpu"].addresses) if "gpu" in resources else (),
        iface=endpoint.iface, network=endpoint.network, missing=missing_programs(spec), **services.ports(),
        **stack_of_this_host(),
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
    task = TaskDir(names.new_temp_dir(names.TASK_DIR_PREFIX % (spec.run_id, "p%d" % partition, os.getpid())))
    client = ChannelClient(spec.channel, wire.Credentials.of(spec.secret, wire.ROLE_TASK), on_lost=lambda: abort_task(task), on_stop=procs.kill_all)
    if spec.channel is not None and not client.connected:
        shutil.rmtree(task.path, ignore_errors=True)
        raise TaskFailure(unreachable_driver(spec.channel, partition, executor, client.connect_error))
    coordinator = ChannelCoordinator(client, partition) if client.connected else SparkCoordinator(ctx)
    endpoint = task_endpoint(client.source_address, executor)  # one rule for Gloo and mpirun
    client.send(messages.Hello(partition, executor))
    services = None
    try:
        task.payload.write_bytes(spec.payload)
        env = base_env(spec, task)
        launcher = launcher_of(spec.launcher)
        services = launcher.serve(spec, partition, executor, endpoint.address, task, env, client)
        plan: Plan | None = None
        failure: Failure | None = None
        try:
            plan = coordinator.plan(task_facts(ctx, spec, partition, executor, endpoint, task, services), spec)
            prepare(spec, plan, partition, task, services, batches)
            coordinator.ready(plan, spec)
            with ship_checkpoints(spec, task, rank0=partition == 0):
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
        failed = failure is not None or client.stopped.is_set()
        coordinator.finish(failure, rank_tails(mine) if failed else {})
        rows: list[dict[str, Any]] = []
        if any(s.rank == 0 for s in mine) and task.result.exists():
            rows += result_rows(partition, "result", task.result.read_bytes(), RESULT_CHUNK)
        if not client.connected:
            rows += result_rows(partition, "logs", json.dumps(rank_tails(mine)).encode(), RESULT_CHUNK)
        return rows
    finally:
        if services is not None:
            services.close()
        client.close()
        shutil.rmtree(task.path, ignore_errors=True)


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
    try:
        missing = missing_programs(spec)
        if missing:
            raise TaskFailure(Failure("%s not found on the driver's PATH. Install Open MPI (apt-get install "
                                      "openmpi-bin) or use launcher='gloo'." % " and ".join(missing)))
        here = endpoint_of(LOOPBACK)
        facts = [TaskFacts(partition=i, executor="driver", address=here.address, pid=os.getpid(), task_dir=str(task.path),
                           python=platform.python_version(), iface=here.iface, network=here.network) for i in range(np)]
        plan = make_plan(facts)
        task.plan.write_text(plan.to_json())
        task.payload.write_bytes(spec.payload)
        hand_over_rank_keys(spec, list(plan.slots))
        env = base_env(spec, task)
        with ship_checkpoints(spec, task, rank0=True):
            failure = launcher_of(spec.launcher).start_local(spec, plan, task, env)
        uploaded = upload_artifacts(spec, task)
        failure = failure or uploaded
        if failure is not None:
            raise TaskFailure(failure.with_tail(rank_tails([s for s in plan.slots if s.rank == failure.rank]).get(str(failure.rank), [])))
        return task.result.read_bytes()
    finally:
        shutil.rmtree(task.path, ignore_errors=True)
