"""What the launchers share on a host: the rank process's command (``WORKER``, or the stub before it
when the task has a warm process: ``rank_command``), the executor's warm process (``start_warm``),
starting one rank process per slot and reaping it, running a program with no watchdog of its own (``mpirun``) under a
reaper, and handing a key over in a private file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
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

__all__ = ["WORKER", "hand_over_key", "rank_command", "run_rank_processes", "run_reaped", "start_warm", "stop_warm", "warm_owner"]


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
    only after the fork). ``proc`` only where this process started it and ends it (``np < 0``); a
    kept one is found in its folder by any task of its owner (``start_warm``) and ends with that owner."""

    def __init__(self, key: tuple, proc: subprocess.Popen | None, socket_path: str, kept: bool) -> None:
        self.key = key
        self.proc = proc
        self.socket_path = socket_path
        self.kept = kept

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            procs.kill_tree(self.proc, grace_s=WARM_STOP_GRACE_S)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)


KEPT_WARM = 2  # at most per owner: one per training stack (Horovod's, torch's); each holds its imports' memory
PROBE_S = 2.0  # a live warm process's listener takes a connection at once (its backlog, while it imports)
_started: list[subprocess.Popen] = []  # the warm processes this Python worker started: reaped once they end


def warm_key(env: dict[str, str], modules: tuple[str, ...]) -> tuple:
    from airflow_provider_horovod.runner.launchers import read_after_fork

    return (sys.executable, os.getcwd(), modules,
            tuple(sorted((k, v) for k, v in env.items() if not read_after_fork(k))))


def warm_owner() -> int:
    """Whose end is a kept warm process's end: the pyspark daemon this Python worker was forked from
    (``spark.python.use.daemon``, the default on Linux), which lives as long as the executor and
    outlives its workers, else this process (a worker Spark started on its own, or a driver)."""
    ppid = os.getppid()
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    try:
        with open("/proc/%d/cmdline" % ppid, "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        uid = os.stat("/proc/%d" % ppid).st_uid
        pgid = os.getpgid(0)
    except OSError:
        return os.getpid()
    return ppid if is_daemon_parent(argv, getattr(main, "name", None), uid == os.getuid(), pgid == ppid) else os.getpid()


def is_daemon_parent(parent_argv: list[str], main_module: str | None, same_uid: bool, its_group: bool) -> bool:
    """Whether this process was forked by a pyspark daemon: its parent runs ``python -m M`` (``M``
    is ``pyspark.daemon``, or what ``spark.python.daemon.module`` names), this process's
    ``__main__`` is that same ``M`` (a fork shares it; a worker Spark starts itself runs
    ``pyspark.worker``), the parent is this user's and leads this process's group (the daemon's
    ``os.setpgid(0, 0)``)."""
    if not (same_uid and its_group and main_module and main_module != "pyspark.worker"):
        return False
    module = next((parent_argv[i + 1] for i, a in enumerate(parent_argv[:-1]) if a == "-m"), None)
    return module == main_module


def warm_dir(owner: int, key: tuple) -> str:
    """The folder of ``owner``'s warm process for ``key`` (its socket, its log): named after the
    owner, so ``names.sweep_orphans`` removes it once the owner is gone. A hash of the key, short
    enough for a socket's path (108 bytes)."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[: names.WARM_KEY_CHARS]
    return os.path.join(tempfile.gettempdir(), names.WARM_DIR % (owner, digest))


def private_dir(path: str) -> bool:
    """Whether ``path`` may be trusted with a rank's descriptors: a real folder (not a link), this
    user's, 0700. ``/tmp`` is shared: anything else there is someone else's, or a trap."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def probe(socket_path: str) -> bool:
    """Whether a warm process listens at ``socket_path``: a connection it takes (or queues while it
    imports) and drops at once; refused or missing, it is gone (``rank/warm.py`` ignores the empty request)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(PROBE_S)
    try:
        sock.connect(socket_path)
        return True
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # a full backlog (timeout): busy, not gone
        return True
    finally:
        sock.close()


def start_warm(task: TaskDir, env: dict[str, str], modules: tuple[str, ...], *, keep: bool = True) -> Warm | None:
    """The warm process that forks this task's ranks (``rank/warm.py``), reached at ``warm.sock`` in
    the task's folder: ``None`` when the run's ranks start cold (``HVDRUNNER_WARM=0``, or no usable folder).

    ``keep``: the process is kept for every later task of its owner (``warm_owner``: the executor's
    pyspark daemon, shared by all its Python workers; else this worker) while nothing its imports
    could have read changed (``warm_key``), in the owner's folder for that key (``warm_dir``), so a
    later run or a restart on this executor forks ranks that imported nothing, even on new Python
    workers. The first task to need it starts it, its imports overlapping the plan and the launch;
    the other tasks of the stage use it. Otherwise (``np < 0``) one is started in the task's folder
    and ends with the task. It imports ``modules`` in the environment ``env`` (a kept one less the
    names that name the task's folder, read only after the fork), ends with its owner (its pidfd),
    and holds no state of any run: it only imported, and every rank is a fork of it.
    """
    if not warm(env):
        return None
    key = warm_key(env, modules)
    if not keep:
        proc = _start(str(task.path), os.path.join(task.path, names.WARM_SOCKET), env, modules, os.getpid())
        return None if proc is None else Warm(key, proc, str(task.warm_socket), kept=False)
    _started[:] = [p for p in _started if p.poll() is None]
    owners = dict.fromkeys([warm_owner(), os.getpid()])  # the daemon's; this worker's own if that one is not ours
    for owner in owners:
        path = _kept_warm(owner, key, _naming_no_task(env, str(task.path)), modules)
        if path is not None:
            with contextlib.suppress(OSError):
                os.symlink(path, task.warm_socket)
                return Warm(key, None, path, kept=True)
            return None
    return None


def _kept_warm(owner: int, key: tuple, env: dict[str, str], modules: tuple[str, ...]) -> str | None:
    """The socket of ``owner``'s warm process for ``key``: used, started, or a stale one replaced;
    ``None`` if its folder is not ours to trust (``private_dir``)."""
    folder = warm_dir(owner, key)
    path = os.path.join(folder, names.WARM_SOCKET)
    for _ in range(5):  # each round: someone else won a race, and we look again
        if os.path.lexists(folder):
            if not private_dir(folder):
                return None
            if probe(path):
                with contextlib.suppress(OSError):
                    os.utime(folder)  # used: the last to be evicted
                return path
            _move_aside(folder, alive=False)
            continue
        made = _create(owner, folder, env, modules)
        if made is None:
            return None
        if made:
            _evict(owner, keep=folder)
            return path
    return None


def _create(owner: int, folder: str, env: dict[str, str], modules: tuple[str, ...]) -> bool | None:
    """Start ``owner``'s warm process in a new private folder, then rename that folder to ``folder``:
    it appears complete (its socket listening) or not at all; a task that lost the race to another
    kills what it started and uses the winner's (``False``). ``None``: none can start (a socket path
    over 108 bytes)."""
    fresh = str(names.new_temp_dir(names.WARM_DIR_PREFIX % owner))
    proc = _start(fresh, os.path.join(folder, names.WARM_SOCKET), env, modules, owner)
    if proc is None:
        shutil.rmtree(fresh, ignore_errors=True)
        return None
    try:
        os.rename(fresh, folder)  # fails if another task's folder is there (not empty)
    except OSError:
        proc.kill()  # before its imports: no cleanup of its own runs (it would name the winner's folder)
        proc.wait()
        shutil.rmtree(fresh, ignore_errors=True)
        return False
    _started.append(proc)
    return True


def _naming_no_task(env: dict[str, str], task_path: str) -> dict[str, str]:
    """``env`` less the names that name the task's folder (its plan, its payload: each read only after
    the fork): a kept warm process outlives the task, and a task's janitor ends whatever names its folder."""
    from airflow_provider_horovod.runner.launchers import read_after_fork

    return {k: v for k, v in env.items() if not (read_after_fork(k) and task_path in v)}


def _start(folder: str, path: str, env: dict[str, str], modules: tuple[str, ...], owner: int) -> subprocess.Popen | None:
    """Bind ``warm.sock`` in ``folder`` (0600 in the 0700 folder) and start the warm process on it;
    ``path``: where the socket will be found. Bound and listening before any rank can look for it: a
    stub that comes while the modules import waits in the backlog (the warm process answers once
    they are in)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            listener.bind(os.path.join(folder, names.WARM_SOCKET))
        finally:
            os.umask(old)
        listener.listen(64)
        with open(os.path.join(folder, names.WARM_LOG), "ab") as out:
            # not one of spawn's children: a stop (kill_all) ends the ranks, not what the next attempt forks from
            return subprocess.Popen([*WARM, str(listener.fileno()), path, str(owner), *modules], env=env,
                                    start_new_session=True, close_fds=True, pass_fds=(listener.fileno(),),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError:  # a folder path too long for a socket's name (108 bytes): every rank starts cold
        return None
    finally:
        listener.close()


def _move_aside(folder: str, *, alive: bool) -> bool:
    """Take ``folder`` out of every task's sight, atomically, under its lock (``flock`` on the folder:
    whoever moves a folder checks first that the name still holds the one it judged), then remove
    it. ``alive``: its warm process is asked to stop (no more connections; it ends once the ranks it
    forked have); else it is gone (a stale folder: SIGKILL, or its start cut short)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.fstat(fd).st_ino == os.lstat(folder).st_ino
        except OSError:
            same = False
        if not same or probe(os.path.join(folder, names.WARM_SOCKET)) != alive:
            return False  # replaced or judged by someone else meanwhile
        aside = str(names.new_temp_dir(names.WARM_DIR_PREFIX % _owner_of(folder)))  # empty: rename replaces it
        try:
            os.rename(folder, aside)
        except OSError:
            os.rmdir(aside)
            return False
    except OSError:
        return False
    finally:
        os.close(fd)
    if alive:
        _ask_to_stop(os.path.join(aside, names.WARM_SOCKET))
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _owner_of(folder: str) -> int:
    return int(os.path.basename(folder).split("-")[1])


def _ask_to_stop(socket_path: str) -> None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_S)
        sock.connect(socket_path)
        body = json.dumps({"stop": True}).encode()
        sock.sendall(struct.pack("!I", len(body)) + body)


def _evict(owner: int, keep: str) -> None:
    """At most ``KEPT_WARM`` warm processes per owner: the least recently used go (asked to stop:
    the ranks another task runs from one keep running)."""
    root = os.path.dirname(keep)
    pattern = re.compile(names.WARM_DIR_RE % owner)
    kept = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if pattern.match(entry.name) and entry.path != keep and private_dir(entry.path):
                with contextlib.suppress(OSError):
                    kept.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
    for _, folder in sorted(kept)[: max(0, len(kept) - (KEPT_WARM - 1))]:
        _move_aside(folder, alive=True)


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
