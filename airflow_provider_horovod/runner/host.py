"""What every launcher's host side shares: the run's spec and base environment, the keys handed to
the ranks, starting rank processes and explaining their exits, and handing rank 0's artifacts and
result back. Barrier tasks (``barrier.run_task``) and the driver's local ranks (``barrier.run_local``)
share it; what differs per launcher is in ``launchers/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import names, procs, wire
from airflow_provider_horovod.runner.dataset import DatasetSpec
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.keras_guard import LEGACY_KERAS_ENV
from airflow_provider_horovod.runner.launchers import launcher_of
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.options import DEFAULT_STALL_TIMEOUT_S, Launcher
from airflow_provider_horovod.runner.plan import Slot

WORKER = [sys.executable, "-m", "airflow_provider_horovod.runner.worker"]


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

    The launcher adds its own (``host_env``: under mpirun, what ``horovodrun --mpi`` sets and
    Horovod's stall check; an orted passes its environment to its ranks); the user's ``env=`` may
    still set any of it otherwise. A rank's own contract comes from its launcher's ``slot_env``.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in names.HOROVOD_RANK_CONTRACT and not names.is_secret_env(k)}
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
            "PYTHONUNBUFFERED": "1",
        }
    )
    if spec.resume_local:
        env[names.ENV_RESUME_DIR] = spec.resume_local
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


def run_rank_processes(slots: list[Slot], env: dict[str, str], slot_env: Callable[[Slot], dict[str, str]]) -> Failure | None:
    """Start one rank process per slot (``env`` plus its launcher's ``slot_env``), wait for all;
    return the first failure, if any. Gloo and torch start their ranks so; mpirun has orted do it.

    The wait blocks in ``waitpid`` (one thread per rank): nothing on this host wakes up while the
    ranks train, and an exit is seen the moment it happens.
    """
    running: list[subprocess.Popen] = []
    ended: queue.Queue[tuple[Slot, subprocess.Popen, int]] = queue.Queue()
    try:
        for slot in slots:
            rank_env = {**env, **slot_env(slot), names.ENV_RANK: str(slot.rank)}
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


def run_reaped(argv: list[str], env: dict[str, str], out_path: Path) -> tuple[int, int]:
    """Run a program with no watchdog of its own (``mpirun``) under a reaper that dies with this
    process; its output to ``out_path``. Returns its exit code and pid."""
    with out_path.open("wb") as out:
        proc = procs.spawn(procs.reaped(argv, os.getpid()), env, stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
    try:
        return proc.wait(), proc.pid
    finally:
        if proc.poll() is None:
            procs.kill_tree(proc)


def missing_programs(spec: RunSpec) -> tuple[str, ...]:
    """Programs ``spec``'s launcher needs that the PATH of its ranks lacks."""
    return launcher_of(spec.launcher).missing_programs(spec.env.get("PATH", os.environ.get("PATH", "")))


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
