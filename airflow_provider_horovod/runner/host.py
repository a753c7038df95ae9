"""What one host runs once it has the plan: the rank processes (Gloo) or ``mpirun``, and how a
rank's exit is explained. Barrier tasks (``barrier.run_task``) and the driver's local ranks
(``barrier.run_local``) share it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import names, procs, wire
from airflow_provider_horovod.runner.dataset import DatasetSpec
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.keras_guard import LEGACY_KERAS_ENV
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.options import DEFAULT_STALL_TIMEOUT_S, Launcher
from airflow_provider_horovod.runner.plan import Plan, Slot, gloo_env
from airflow_provider_horovod.runner.stall import stall_env

WORKER = [sys.executable, "-m", "airflow_provider_horovod.runner.worker"]
OPEN_MPI_PROGRAMS = ("mpirun", "orted")  # what mpirun needs on every host's PATH


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a barrier task needs; pickled into the task's closure (never shown in Spark's UI)."""

    run_id: str
    secret: bytes = dataclasses.field(repr=False)
    payload: bytes = dataclasses.field(repr=False)
    launcher: Launcher
    verbosity: str
    channel: tuple[str, int] | None
    env: dict[str, str] = dataclasses.field(repr=False)
    driver_python: str
    driver_stack: dict[str, str] = dataclasses.field(default_factory=dict)  # environment.stack_of_this_host()
    gloo_timeout_s: int = 60
    stall_timeout_s: int = int(DEFAULT_STALL_TIMEOUT_S)  # Horovod's stall shutdown (``stall.stall_env``)
    timeline: bool = False
    collect_artifacts: bool = False
    has_resume: bool = False
    resume_local: str | None = None  # np < 0: the folder itself, on the driver
    dataset: DatasetSpec | None = None  # dataset=: each task spills its partition for its rank


def base_env(spec: RunSpec, task: TaskDir) -> dict[str, str]:
    """The environment of every process this host starts for the run (values never reach a shell).
    It holds no key: ranks and the rsh agent read theirs from a private file (``hand_over_key``),
    and none of the task's secrets (``names.is_secret_env``); the user's ``env=`` is passed as given.

    The launcher's contract is what ``horovodrun`` gives that launcher: under mpirun, MPI says who
    is which rank and no ``HOROVOD_RANK`` & co are set (see ``names``). Horovod's stall check is
    set from ``stall_timeout`` under both launchers (an orted passes its environment to its ranks);
    the user's ``env=`` may still set it otherwise.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in names.HOROVOD_RANK_CONTRACT and not names.is_secret_env(k)}
    env.update(stall_env(spec.stall_timeout_s))
    env.update(spec.env)
    # Keras 2 (tf-keras) for horovod.tensorflow.keras; TensorFlow reads it at its first import
    env.setdefault(LEGACY_KERAS_ENV, "1")  # the user's own value (driver, executor or env=) wins
    env.update(
        {
            names.ENV_PLAN: str(task.plan),
            names.ENV_PAYLOAD: str(task.payload),
            names.ENV_CHANNEL: "%s:%d" % spec.channel if spec.channel else "",
            names.ENV_VERBOSITY: spec.verbosity,
            names.ENV_LAUNCHER: spec.launcher,
            names.ENV_TIMELINE: "1" if spec.timeline else "0",
            names.ENV_HAS_RESUME: "1" if spec.has_resume and not spec.resume_local else "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if spec.resume_local:
        env[names.ENV_RESUME_DIR] = spec.resume_local
    if spec.launcher == Launcher.MPIRUN:
        env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"})
    return env


def hand_over_key(path: Path, key: bytes) -> None:
    """Write ``key`` where only this user can read it, for one process to pick up (not in its environ)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())


def hand_over_rank_keys(spec: RunSpec, slots: list[Slot]) -> None:
    """Each rank's own channel key (its logs and failure report only, as that rank) beside its task."""
    for slot in slots:
        hand_over_key(TaskDir(slot.task_dir).rank_key(slot.rank), wire.role_key(spec.secret, wire.rank_role(slot.rank)))


def tail(path: Path, n: int = names.TAIL_LINES) -> list[str]:
    with contextlib.suppress(OSError), path.open("rb") as f:
        return [line.decode("utf-8", "replace").rstrip("\n") for line in deque(f, maxlen=n)]
    return []


def exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return "was killed by %s" % signal.Signals(-code).name
        return "was killed by signal %d" % -code
    return "exited with code %d" % code


def where(slot: Slot | None) -> str:
    if slot is None:
        return "The job"
    return "Rank %d on host %s (executor %s)" % (slot.rank, slot.hostname, slot.executor)


def read_error_file(task: TaskDir, rank: int) -> Failure | None:
    with contextlib.suppress(OSError, ValueError, TypeError):
        return Failure.from_json(json.loads(task.error(rank).read_text()))
    return None


def rank_exit_failure(slot: Slot, code: int, *, stopping: bool) -> Failure:
    """Why the rank of ``slot`` ended with ``code``: its own report, or one made from its exit.
    ``stopping``: this host ended it (the driver said stop), so it is not a cause of its own."""
    task = TaskDir(slot.task_dir)
    own = read_error_file(task, slot.rank)
    if own is not None:
        return dataclasses.replace(own, exit=exit_text(code), consequence=stopping)
    how = exit_text(code)
    return Failure(
        message="%s %s%s" % (where(slot), how, " after the job was told to stop" if stopping else ""),
        rank=slot.rank, host=slot.hostname, executor=slot.executor, exit=how,
        tail=tuple(tail(task.rank_log(slot.rank))), consequence=stopping,
    )


def run_gloo_ranks(spec: RunSpec, slots: list[Slot], rendezvous: tuple[str, int], env: dict[str, str]) -> Failure | None:
    """Start one rank process per slot, wait for all; return the first failure, if any.

    The wait blocks in ``waitpid`` (one thread per rank): nothing on this host wakes up while the
    ranks train, and an exit is seen the moment it happens.
    """
    running: list[subprocess.Popen] = []
    ended: queue.Queue[tuple[Slot, subprocess.Popen, int]] = queue.Queue()
    try:
        for slot in slots:
            rank_env = dict(env)
            rank_env.update(gloo_env(rendezvous[0], rendezvous[1], slot.iface, spec.gloo_timeout_s,
                                     wire.rendezvous_token(spec.secret)))
            rank_env[names.ENV_RANK] = str(slot.rank)
            with TaskDir(slot.task_dir).rank_log(slot.rank).open("wb") as out:
                proc = procs.spawn(WORKER, rank_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            running.append(proc)
            threading.Thread(target=lambda s=slot, p=proc: ended.put((s, p, p.wait())), daemon=True).start()
        for _ in running:
            slot, proc, code = ended.get()
            if code != 0:
                return rank_exit_failure(slot, code, stopping=procs.killed_by_us(proc.pid))
        return None
    finally:
        for proc in running:
            if proc.poll() is None:
                procs.kill_tree(proc)


def run_mpirun(argv: list[str], env: dict[str, str], watch_pid: int, out_path: Path) -> tuple[int, int]:
    """Run ``mpirun`` under a reaper (it dies with ``watch_pid``); return its exit code and pid."""
    with out_path.open("wb") as out:
        proc = procs.spawn(procs.reaped(argv, watch_pid), env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        return proc.wait(), proc.pid
    finally:
        if proc.poll() is None:
            procs.kill_tree(proc)


_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_PROCESS_NAME = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
_ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+\s+with errorcode (-?\d+)")


def parse_mpirun_exit(lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code; negative: signal) of the first rank mpirun reports as failed, if it says."""
    text = "\n".join(lines)
    found = _SIGNALLED.search(text)
    if found:
        return int(found.group(1)), -int(found.group(2))
    name, code = _PROCESS_NAME.search(text), _EXIT_CODE.search(text)
    if name and code:
        return int(name.group(1)), int(code.group(1))
    aborted = _ABORTED.search(" ".join(lines))
    if aborted:
        return int(aborted.group(1)), int(aborted.group(2))
    return None


def mpirun_failure(plan: Plan, code: int, task: TaskDir, *, stopping: bool) -> Failure:
    """Why mpirun failed: the failing rank (its own report when it made one), then mpirun's words."""
    said = tail(task.mpirun_log)
    orted = tail(task.orted_log, 30)
    agent = tail(task.rsh_log, 30)
    launcher_output = tuple(said + (["-- orted on this host:"] + orted if orted else [])
                            + (["-- the rsh agent:"] + agent if agent else []))
    reports = [f for f in (read_error_file(TaskDir(s.task_dir), s.rank) for s in plan.slots) if f is not None]
    if reports:
        first = min(reports, key=lambda f: f.time)
        return dataclasses.replace(first, launcher_output=launcher_output, consequence=stopping)
    exited = parse_mpirun_exit(said)
    slot = plan.slots[exited[0]] if exited is not None and exited[0] < plan.size else None
    if slot is not None:
        how = exit_text(exited[1])
        own_log = TaskDir(slot.task_dir).rank_log(slot.rank)
        return Failure(message="%s %s" % (where(slot), how), rank=slot.rank, host=slot.hostname,
                       executor=slot.executor, exit=how, tail=tuple(tail(own_log)),
                       launcher_output=launcher_output, consequence=stopping)
    return Failure(message="mpirun %s before any rank reported why" % exit_text(code if code < 128 else 128 - code),
                   exit=exit_text(code), launcher_output=launcher_output, consequence=stopping)


def missing_programs(spec: RunSpec) -> tuple[str, ...]:
    if spec.launcher != Launcher.MPIRUN:
        return ()
    path = spec.env.get("PATH", os.environ.get("PATH", ""))
    return tuple(p for p in OPEN_MPI_PROGRAMS if shutil.which(p, path=path) is None)


def run_ranks(spec: RunSpec, plan: Plan, slots: list[Slot], task: TaskDir, env: dict[str, str], *,
              rendezvous: tuple[str, int] | None = None, mpirun: list[str] | None = None) -> Failure | None:
    """The ranks of this host, to their end: Gloo starts ``slots`` itself; under mpirun the host
    given ``mpirun`` (its argv) runs it, and every other host only serves its exec service."""
    if spec.launcher == Launcher.GLOO:
        assert rendezvous is not None
        return run_gloo_ranks(spec, slots, rendezvous, env)
    if mpirun is None:
        return None
    code, pid = run_mpirun(mpirun, env, os.getpid(), task.mpirun_log)
    return mpirun_failure(plan, code, task, stopping=procs.killed_by_us(pid)) if code != 0 else None


def rank_tails(slots: list[Slot]) -> dict[str, list[str]]:
    """The last lines of this host's ranks, from their log files."""
    out = {}
    for slot in slots:
        lines = tail(TaskDir(slot.task_dir).rank_log(slot.rank))
        if lines:
            out[str(slot.rank)] = lines
    return out


def upload_artifacts(spec: RunSpec, task: TaskDir) -> Failure | None:
    """Hand rank 0's artifacts (checkpoints, timeline) to the driver; bounded. A hand-over that
    fails is the run's failure (returned, never raised): a run must not end as a success with a
    complete, empty marker while its checkpoint stayed behind.

    The driver copies them itself when it can prove it sees this folder (same host), otherwise
    they are streamed over the channel.
    """
    from airflow_provider_horovod.runner.artifacts import RefusedError, upload_tree

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


def result_rows(partition: int, kind: str, data: bytes, chunk: int) -> list[dict[str, Any]]:
    return [
        {"partition": partition, "kind": kind, "seq": i, "data": data[off : off + chunk]}
        for i, off in enumerate(range(0, max(len(data), 1), chunk))
    ]
