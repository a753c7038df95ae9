"""What the launchers share on a host: the rank process's command (``WORKER``, or the stub before it
when the task has a warm process: ``rank_command``), the task's warm process (``start_warm``),
starting one rank process per slot and reaping it, running a program with no watchdog of its own (``mpirun``) under a
reaper, and handing a key over in a private file.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
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

WORKER_MODULE = "airflow_provider_horovod.runner.rank.worker"
WORKER = [sys.executable, "-m", WORKER_MODULE]
STUB = [sys.executable, "-m", "airflow_provider_horovod.runner.rank.stub"]  # then the cold command (rank/stub.py)
WARM = [sys.executable, "-m", "airflow_provider_horovod.runner.rank.warm"]
WARM_STOP_GRACE_S = 0.5

__all__ = ["WORKER", "hand_over_key", "rank_command", "run_rank_processes", "run_reaped", "start_warm", "stop_warm"]


def warm(env: dict[str, str]) -> bool:
    """Whether the run's ranks are forked by their task's warm process (``HVDRUNNER_WARM`` not "0")."""
    return env.get(names.ENV_WARM, "1") != "0"


def rank_command(env: dict[str, str]) -> list[str]:
    """A rank's command: the stub, then the worker it execs if no warm process forks the rank; the
    worker alone when the run's ranks start cold."""
    return [*STUB, *WORKER] if warm(env) else list(WORKER)


class Warm:
    """A warm process (``rank/warm.py``) and what it was started for: ``key``, everything its imports
    could have read (interpreter, working folder, modules, the environment but for the names read
    only after the fork)."""

    def __init__(self, key: tuple, proc: subprocess.Popen, socket_path: str, kept: bool) -> None:
        self.key = key
        self.proc = proc
        self.socket_path = socket_path
        self.kept = kept

    def serves(self, key: tuple) -> bool:
        return self.key == key and self.proc.poll() is None and os.path.exists(self.socket_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            procs.kill_tree(self.proc, grace_s=WARM_STOP_GRACE_S)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        if self.kept:  # its own folder (socket, log); otherwise the task's, which the task removes
            shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)


_kept: dict[tuple, Warm] = {}  # this process's warm processes by key, kept for its next tasks (a Spark Python worker is reused)
KEPT_WARM = 2  # at most: one per training stack (Horovod's, torch's); each holds its imports' memory


def warm_key(env: dict[str, str], modules: tuple[str, ...]) -> tuple:
    from airflow_provider_horovod.runner.launchers import read_after_fork

    return (sys.executable, os.getcwd(), modules,
            tuple(sorted((k, v) for k, v in env.items() if not read_after_fork(k))))


def start_warm(task: TaskDir, env: dict[str, str], modules: tuple[str, ...], *, keep: bool = True) -> Warm | None:
    """The warm process that forks this task's ranks (``rank/warm.py``), reached at ``warm.sock`` in
    the task's folder: ``None`` when the run's ranks start cold (``HVDRUNNER_WARM=0``).

    ``keep``: the process is this Spark Python worker's, kept for its next task while nothing its
    imports could have read changed (``warm_key``), so a later run or restart on this worker forks
    ranks that imported nothing; otherwise one is started now, its imports overlapping the plan and the
    launch. It imports ``modules`` in the environment ``env`` (what the ranks will have, but for the
    names read only after the fork), ends with this process (its pidfd), and holds no state of any run:
    it only imported, and every rank is a fork of it.
    """
    if not warm(env):
        return None
    key = warm_key(env, modules)
    kept = _kept.get(key)
    if keep and kept is not None and kept.serves(key):
        with contextlib.suppress(OSError):
            os.symlink(kept.socket_path, task.warm_socket)
            return kept
    if keep:
        if kept is not None:
            _kept.pop(key).stop()
        while len(_kept) >= KEPT_WARM:  # the oldest goes (a worker that alternates two stacks keeps both)
            _kept.pop(next(iter(_kept))).stop()
    folder = names.new_temp_dir(names.WARM_DIR_PREFIX % os.getpid()) if keep else task.path
    path = os.path.join(folder, names.WARM_SOCKET)
    # bound and listening before any rank can look for it: a stub that comes while the modules import
    # waits in the backlog (the warm process answers once they are in)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            listener.bind(path)  # 0600, in a 0700 folder
        finally:
            os.umask(old)
        listener.listen(64)
        with open(os.path.join(folder, names.WARM_LOG), "ab") as out:
            # not one of spawn's children: a stop (kill_all) ends the ranks, not what the next attempt forks from
            proc = subprocess.Popen([*WARM, str(listener.fileno()), path, str(os.getpid()), *modules], env=env,
                                    start_new_session=True, close_fds=True, pass_fds=(listener.fileno(),),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError:  # a folder path too long for a socket's name (108 bytes): every rank starts cold
        return None
    finally:
        listener.close()
    started = Warm(key, proc, path, keep)
    if keep:
        _kept[key] = started
        with contextlib.suppress(OSError):
            os.symlink(path, task.warm_socket)
    return started


def stop_warm(started: Warm | None) -> None:
    """The task ends: a warm process that is not kept goes (with any rank it forked still there)."""
    if started is not None and not started.kept:
        started.stop()


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
                proc = procs.spawn(rank_command(rank_env), rank_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
