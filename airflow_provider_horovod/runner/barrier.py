"""What each Spark barrier task runs, in named phases: gather, plan, start, wait, collect.

The same host-side phases run on the driver for ``np < 0`` (``run_local``), with no Spark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import procs
from airflow_provider_horovod.runner.channel import ChannelClient
from airflow_provider_horovod.runner.plan import Plan, Slot, TaskFacts, gloo_env, make_plan, slot_summary
from airflow_provider_horovod.runner.worker import ERROR_FILE, RESULT_FILE

ERROR_MARKER = "@@HVDRUNNER-ERROR@@"
RESULT_CHUNK = 4 * 1024 * 1024
WORKER = [sys.executable, "-m", "airflow_provider_horovod.runner.worker"]
TAIL_LINES = 100


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a barrier task needs; pickled into the task's closure (never shown in Spark's UI)."""

    run_id: str
    secret: bytes
    payload: bytes
    launcher: str
    verbosity: str
    channel: tuple[str, int] | None
    env: dict[str, str]
    driver_python: str
    gloo_timeout_s: int = 60
    timeline: bool = False
    collect_artifacts: bool = False
    has_resume: bool = False
    resume_local: str | None = None  # np < 0: the folder itself, on the driver


class TaskFailure(RuntimeError):
    """Raised in a barrier task; its message carries a JSON report the driver parses."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        summary = report.get("exception") or report.get("message") or "failed"
        super().__init__("%s\n%s%s%s" % (summary, ERROR_MARKER, json.dumps(report), ERROR_MARKER))


def parse_failure(text: str) -> dict[str, Any] | None:
    """The report inside an exception text that travelled through Spark, if there is one."""
    start = text.find(ERROR_MARKER)
    if start < 0:
        return None
    end = text.find(ERROR_MARKER, start + len(ERROR_MARKER))
    if end < 0:
        return None
    with contextlib.suppress(ValueError):
        return json.loads(text[start + len(ERROR_MARKER) : end])
    return None


def _signal_name(code: int) -> str:
    import signal

    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return "signal %d" % -code


def base_env(spec: RunSpec, plan_path: Path, payload_path: Path) -> dict[str, str]:
    """The environment of every rank process this host starts (values never reach a shell)."""
    env = dict(os.environ)
    env.pop("HOROVOD_TIMELINE", None)  # only ``timeline=True`` turns it on (it costs throughput)
    env.update(spec.env)
    env.update(
        {
            "HVDRUNNER_PLAN": str(plan_path),
            "HVDRUNNER_PAYLOAD": str(payload_path),
            "HVDRUNNER_SECRET": spec.secret.hex(),
            "HVDRUNNER_CHANNEL": "%s:%d" % spec.channel if spec.channel else "",
            "HVDRUNNER_VERBOSITY": spec.verbosity,
            "PYTHONUNBUFFERED": "1",
            "HVDRUNNER_TIMELINE": "1" if spec.timeline else "0",
            "HVDRUNNER_HAS_RESUME": "1" if spec.has_resume and not spec.resume_local else "0",
        }
    )
    if spec.resume_local:
        env["HVDRUNNER_RESUME_DIR"] = spec.resume_local
    return env


def upload_artifacts(spec: RunSpec, task_dir: Path) -> None:
    """Hand rank 0's artifacts (checkpoints, timeline) to the driver; bounded, never raises.

    The driver copies them itself when it can prove it sees this folder (same host), otherwise
    they are streamed over the channel.
    """
    from airflow_provider_horovod.runner import wire
    from airflow_provider_horovod.runner.artifacts import offer_tree

    if not spec.collect_artifacts or spec.channel is None:
        return
    with contextlib.suppress(OSError, ValueError):
        conn = wire.connect(spec.channel, spec.secret, timeout=10)
        try:
            conn.sock.settimeout(60)  # the driver answers, or sends a heartbeat, well within this
            conn.send({"t": "put"})
            offer_tree(conn, task_dir / "artifacts", task_dir)
        finally:
            conn.close()


def fetch_resume(spec: RunSpec, dest: Path) -> None:
    """Copy the driver's ``resume_from`` folder to ``dest`` on this host (in the kernel if this host is the driver's)."""
    from airflow_provider_horovod.runner import wire
    from airflow_provider_horovod.runner.artifacts import take_tree

    if spec.channel is None:
        raise TaskFailure({"message": "resume_from needs the executors to reach the driver, and they cannot here. "
                                      "Put the checkpoint where the training function can read it and pass its path instead."})
    conn = wire.connect(spec.channel, spec.secret, timeout=10)
    try:
        conn.send({"t": "fetch-resume"})
        _mode, files = take_tree(conn, dest)
        conn.send({"ok": True, "files": len(files)})
    finally:
        conn.close()


def _tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    with contextlib.suppress(OSError), path.open("rb") as f:
        return [line.decode("utf-8", "replace").rstrip("\n") for line in deque(f, maxlen=n)]
    return []


def rank_error(slot: Slot, code: int, log_path: Path | None) -> dict[str, Any]:
    """The report of a rank that exited with ``code``: its own, or one made from its exit."""
    path = Path(slot.task_dir) / (ERROR_FILE % slot.rank)
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    how = "was killed by %s" % _signal_name(code) if code < 0 else "exited with code %d" % code
    return {
        "t": "error",
        "rank": slot.rank,
        "host": slot.hostname,
        "executor": slot.executor,
        "exception": "rank %d %s" % (slot.rank, how),
        "traceback": "",
        "tail": _tail(log_path) if log_path else [],
        "time": time.time(),
    }


def run_gloo_ranks(spec: RunSpec, plan: Plan, slots: list[Slot], rendezvous: tuple[str, int], env: dict[str, str]) -> dict[str, Any] | None:
    """Start one rank process per slot, wait for all; return the first failure's report, if any."""
    running: list[tuple[Slot, subprocess.Popen, Path]] = []
    try:
        for slot in slots:
            log_path = Path(slot.task_dir) / ("rank-%d.log" % slot.rank)
            rank_env = dict(env)
            rank_env.update(gloo_env(rendezvous[0], rendezvous[1], slot.iface, spec.gloo_timeout_s))
            rank_env.update({"HOROVOD_RANK": str(slot.rank)})
            with log_path.open("wb") as out:
                proc = procs.spawn(WORKER, rank_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            running.append((slot, proc, log_path))
        pending = list(running)
        while pending:
            for item in list(pending):
                slot, proc, log_path = item
                code = proc.poll()
                if code is None:
                    continue
                pending.remove(item)
                if code != 0:
                    return rank_error(slot, code, log_path)
            time.sleep(0.05)
        return None
    finally:
        for _, proc, _ in running:
            if proc.poll() is None:
                procs.kill_tree(proc)


def run_mpirun(argv: list[str], env: dict[str, str], watch_pid: int, out_path: Path) -> tuple[int, list[str]]:
    """Run ``mpirun`` under a reaper; return its exit code and the tail of its output."""
    with out_path.open("wb") as out:
        proc = procs.spawn(procs.reaped(argv, watch_pid), env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            procs.kill_tree(proc)
    return code, _tail(out_path)


def mpirun_failure(plan: Plan, code: int, tail: list[str]) -> dict[str, Any]:
    """The report for a failed mpirun: a rank's own report when one is on this host, else mpirun's words."""
    import re

    reports = []
    for slot in plan.slots:
        path = Path(slot.task_dir) / (ERROR_FILE % slot.rank)
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    if reports:
        return min(reports, key=lambda r: r.get("time", 0))
    rank = None
    noticed = next((line.strip() for line in tail if "noticed that process rank" in line), "")
    match = re.search(r"process rank (\d+)", noticed)
    if match:
        rank = int(match.group(1))
    slot = plan.slots[rank] if rank is not None and rank < plan.size else None
    return {
        "t": "error",
        "rank": rank,
        "host": slot.hostname if slot else None,
        "executor": slot.executor if slot else None,
        "exception": noticed or "mpirun exited with code %d" % code,
        "traceback": "",
        "tail": tail,
        "time": time.time(),
    }


def result_rows(partition: int, kind: str, data: bytes) -> list[dict[str, Any]]:
    return [
        {"partition": partition, "kind": kind, "seq": i, "data": data[off : off + RESULT_CHUNK]}
        for i, off in enumerate(range(0, max(len(data), 1), RESULT_CHUNK))
    ]


def _missing_programs(spec: RunSpec) -> tuple[str, ...]:
    if spec.launcher != "mpirun":
        return ()
    path = spec.env.get("PATH", os.environ.get("PATH", ""))
    return tuple(p for p in ("mpirun", "orted") if shutil.which(p, path=path) is None)


def _reachable_address(executor: str) -> str:
    host = executor.rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(OSError):
        return socket.gethostbyname(host)
    return host


def check_facts(spec: RunSpec, facts: list[TaskFacts]) -> None:
    """Refuse to start when an executor cannot run the job; say what to fix."""
    driver_mm = ".".join(spec.driver_python.split(".")[:2])
    for f in facts:
        if ".".join(f.python.split(".")[:2]) != driver_mm:
            raise TaskFailure(
                {
                    "message": "Python %s on executor %s differs from the driver's %s. Point PYSPARK_PYTHON "
                    "at the same Python version on the driver and the executors." % (f.python, f.executor, spec.driver_python),
                    "executor": f.executor,
                }
            )
        if f.missing:
            raise TaskFailure(
                {
                    "message": "%s not found on executor %s (PATH of the task). Install Open MPI on every "
                    "executor (apt-get install openmpi-bin), or use launcher='gloo'." % (" and ".join(f.missing), f.executor),
                    "executor": f.executor,
                }
            )


def abort_task() -> None:
    """The driver hung up mid-run (cancelled, or gone): stop every process of this task, then the
    task's Python worker itself, as Spark would after its kill timeout."""
    procs.kill_all()
    os._exit(1)


def run_task(ctx, spec: RunSpec) -> list[dict[str, Any]]:
    """The whole life of one barrier task. Returns the rows it contributes to the stage's result."""
    from airflow_provider_horovod.runner.gloo import Rendezvous
    from airflow_provider_horovod.runner.mpi import AGENT_HOSTS_ENV, ExecService, interface_for, mpirun_argv, write_agent

    partition = ctx.partitionId()
    executor = ctx.getTaskInfos()[partition].address
    address = _reachable_address(executor)
    task_dir = Path(tempfile.mkdtemp(prefix="hvdrunner-%s-p%d-" % (spec.run_id, partition)))
    client = ChannelClient(spec.channel, spec.secret, on_lost=abort_task, on_stop=procs.kill_all)
    client.send({"t": "event", "kind": "task-started", "partition": partition, "executor": executor})
    service = rendezvous = None
    try:
        resources = ctx.resources()
        gpus = tuple(resources["gpu"].addresses) if "gpu" in resources else ()
        payload_path = task_dir / "payload.pkl"
        payload_path.write_bytes(spec.payload)
        plan_path = task_dir / "plan.json"
        env = base_env(spec, plan_path, payload_path)
        if spec.launcher == "mpirun":
            env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"})

            def on_launch(_argv: list[str]) -> None:
                client.send({"t": "event", "kind": "orted-launched", "partition": partition, "executor": executor})

            service = ExecService(address, spec.secret, env, os.getpid(), on_launch, log_path=task_dir / "orted.log")
        if spec.launcher == "gloo" and partition == 0:
            rendezvous = Rendezvous(address)
        facts = TaskFacts(
            partition=partition,
            executor=executor,
            address=address,
            pid=os.getpid(),
            task_dir=str(task_dir),
            python=platform.python_version(),
            gpus=gpus,
            service_port=service.port if service else 0,
            rendezvous_port=rendezvous.port if rendezvous else 0,
            iface=interface_for(address),
            missing=_missing_programs(spec),
        )
        # gather -------------------------------------------------------------------------------
        gathered = [TaskFacts.from_json(m) for m in ctx.allGather(facts.to_json())]
        check_facts(spec, gathered)
        # plan ---------------------------------------------------------------------------------
        plan = make_plan(gathered)
        plan_path.write_text(plan.to_json())
        slot = plan.for_partition(partition)
        if partition == 0:
            client.send({"t": "event", "kind": "plan", "slots": slot_summary(plan)})
        failure = None
        if spec.has_resume:
            if plan.host_leader(slot.hostname).partition == partition:
                fetch_resume(spec, task_dir / "resume")
            ctx.barrier()  # every host has its copy before any rank starts
        # start and wait -----------------------------------------------------------------------
        if spec.launcher == "gloo":
            if rendezvous is not None:
                rendezvous.init(plan)
            ctx.barrier()  # nobody connects to the rendezvous server before it knows the plan
            root = plan.slots[0]
            server = next(f for f in gathered if f.partition == root.partition)
            failure = run_gloo_ranks(spec, plan, [slot], (root.address, server.rendezvous_port), env)
        elif partition == 0:
            leaders = {name: plan.host_leader(name) for name, _ in plan.hosts}
            ports = {f.partition: f.service_port for f in gathered}
            env[AGENT_HOSTS_ENV] = json.dumps({name: "%s:%d" % (s.address, ports[s.partition]) for name, s in leaders.items()})
            argv = mpirun_argv(plan, WORKER, agent=write_agent(task_dir), iface=slot.iface, np=plan.size, env_names=[])
            code, tail = run_mpirun(argv, env, os.getpid(), task_dir / "mpirun.log")
            if code != 0:
                failure = mpirun_failure(plan, code, tail)
        if slot.rank == 0:
            upload_artifacts(spec, task_dir)  # after a failure too: the last good checkpoint matters
        if failure is not None:
            client.send_now(failure)
            raise TaskFailure(failure)
        ctx.barrier()  # every task stays (and keeps its exec service) until all ranks are done
        # collect ------------------------------------------------------------------------------
        rows: list[dict[str, Any]] = []
        if slot.rank == 0:
            rows += result_rows(partition, "result", (task_dir / RESULT_FILE).read_bytes())
        if not client.connected:
            logs = {s.rank: _tail(Path(s.task_dir) / ("rank-%d.log" % s.rank)) for s in plan.slots if s.partition == partition}
            rows += result_rows(partition, "logs", json.dumps(logs).encode())
        return rows
    finally:
        if service is not None:
            service.close()
        if rendezvous is not None:
            rendezvous.stop()
        client.send({"t": "event", "kind": "task-done", "partition": partition})
        client.close()
        shutil.rmtree(task_dir, ignore_errors=True)


def run_local(spec: RunSpec, np: int) -> Any:
    """``np < 0``: ``np`` rank processes on the driver, no Spark job. Returns rank 0's pickled result."""
    from airflow_provider_horovod.runner.gloo import Rendezvous
    from airflow_provider_horovod.runner.mpi import mpirun_argv

    task_dir = Path(tempfile.mkdtemp(prefix="hvdrunner-%s-local-" % spec.run_id))
    rendezvous = None
    try:
        facts = [
            TaskFacts(partition=i, executor="driver", address="127.0.0.1", pid=os.getpid(), task_dir=str(task_dir),
                      python=platform.python_version(), iface="lo")
            for i in range(np)
        ]
        plan = make_plan(facts)
        plan_path = task_dir / "plan.json"
        plan_path.write_text(plan.to_json())
        payload_path = task_dir / "payload.pkl"
        payload_path.write_bytes(spec.payload)
        env = base_env(spec, plan_path, payload_path)
        missing = _missing_programs(spec)
        if missing:
            raise TaskFailure({"message": "%s not found on the driver's PATH. Install Open MPI (apt-get install "
                               "openmpi-bin) or use launcher='gloo'." % " and ".join(missing)})
        if spec.launcher == "gloo":
            rendezvous = Rendezvous("127.0.0.1")
            rendezvous.init(plan)
            failure = run_gloo_ranks(spec, plan, list(plan.slots), ("127.0.0.1", rendezvous.port), env)
        else:
            env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"})
            argv = mpirun_argv(None, WORKER, agent=None, iface="lo", np=np, env_names=[])
            code, tail = run_mpirun(argv, env, os.getpid(), task_dir / "mpirun.log")
            failure = mpirun_failure(plan, code, tail) if code != 0 else None
        upload_artifacts(spec, task_dir)
        if failure is not None:
            raise TaskFailure(failure)
        return (task_dir / RESULT_FILE).read_bytes()
    finally:
        if rendezvous is not None:
            rendezvous.stop()
        shutil.rmtree(task_dir, ignore_errors=True)
