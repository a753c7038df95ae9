"""What the launchers share on a host: the rank process's command (``WORKER``), starting one rank
process per slot and reaping it, running a program with no watchdog of its own (``mpirun``) under a
reaper, and handing a key over in a private file.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from airflow_provider_horovod.runner import names, procs
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.exits import rank_exit_failure
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.plan import Slot

WORKER = [sys.executable, "-m", "airflow_provider_horovod.runner.rank.worker"]

__all__ = ["WORKER", "hand_over_key", "run_rank_processes", "run_reaped"]


def hand_over_key(path: Path, key: bytes) -> None:
    """Write ``key`` where only this user can read it, for one process to pick up (not in its environ)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())


def run_rank_processes(slots: list[Slot], env: dict[str, str], slot_env: Callable[[Slot], dict[str, str]],
                       pass_fds: Callable[[Slot], tuple[int, ...]] = lambda slot: ()) -> Failure | None:
    """Start one rank process per slot (``env`` plus its launcher's ``slot_env``; the descriptors
    ``pass_fds`` names, inherited), wait for all; return the first failure, if any. Gloo and torch
    start their ranks so; mpirun has orted do it.

    The wait blocks in ``waitpid`` (one thread per rank): nothing on this host wakes up while the
    ranks train, and an exit is seen the moment it happens.
    """
    running: list[subprocess.Popen] = []
    ended: queue.Queue[tuple[Slot, subprocess.Popen, int]] = queue.Queue()
    try:
        for slot in slots:
            rank_env = {**env, **slot_env(slot), names.ENV_RANK: str(slot.rank)}
            with TaskDir(slot.task_dir).rank_log(slot.rank).open("wb") as out:
                proc = procs.spawn(WORKER, rank_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   pass_fds=pass_fds(slot))
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
