"""Child processes: argv lists only, their own process group, a parent-death watchdog, reaping.

``python -m airflow_provider_horovod.runner.procs --watch PID -- argv...`` is the *reaper*: it
runs ``argv`` in a new session and kills that whole session when ``PID`` (the Spark task that
owns it) disappears or the reaper itself is told to stop. ``mpirun`` and ``orted`` are C programs
with no watchdog of their own, so they always run under a reaper.

``python -m airflow_provider_horovod.runner.procs --janitor PID ROOT`` is the *janitor* of a
barrier task (or of the driver's local ranks): a process of its own session that outlives the task,
which Spark may end with SIGKILL (a cancelled job, Ctrl-C in the driver) or its daemon with SIGHUP,
so that no ``finally`` of the task runs. The moment ``PID`` ends it removes that process's task and
session folders in ``ROOT`` (payload, keys, checkpoints), ends every process still working in them,
and removes what they left. A task that ends as it should removes its folder itself and then stops
its janitor (``stop_janitor``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import psutil

from airflow_provider_horovod.runner import launchers, names

WATCH_INTERVAL_S = 0.5
TERM_GRACE_S = 2.0
STOP_GRACE_S = 1.0  # kill_all: a stop or cancel gives rank processes this long between TERM and KILL


def alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_children: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
_killed: set[int] = set()  # pids this process signalled: their end was ours, not their own


def killed_by_us(pid: int) -> bool:
    return pid in _killed


def spawn(argv: Sequence[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    """Start ``argv`` (a list, never a shell string) as the leader of a new session."""
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list")
    proc = subprocess.Popen(list(argv), env=env, start_new_session=True, close_fds=True, **kwargs)
    _children.add(proc)
    return proc


def kill_all(grace_s: float = STOP_GRACE_S) -> None:
    """Kill every process tree this process started with ``spawn`` that is still running."""
    for proc in list(_children):
        if proc.poll() is None:
            kill_tree(proc, grace_s=grace_s)


def kill_tree(proc: subprocess.Popen | int, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM a process's group and all its descendants, then SIGKILL what is left."""
    pid = proc if isinstance(proc, int) else proc.pid
    _killed.add(pid)
    procs: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                p.kill()  # a stopped process never acts on SIGTERM: waiting for it would only cost the grace
            else:
                p.terminate()
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=grace_s)
    if not isinstance(proc, int):
        with contextlib.suppress(Exception):
            proc.wait(timeout=grace_s)


def reaped(argv: Sequence[str], watch_pid: int) -> list[str]:
    """The argv that runs ``argv`` under a reaper watching ``watch_pid``."""
    return [sys.executable, "-m", "airflow_provider_horovod.runner.procs", "--watch", str(watch_pid), "--", *argv]


def start_watchdog(pids: Iterable[int], on_death, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Call ``on_death(pid)`` from a daemon thread as soon as any of ``pids`` is gone.

    The parent of the calling process is watched too: if it changes, the parent died.
    """
    watched = [p for p in pids if p > 0]
    parent = os.getppid()

    def loop() -> None:
        while True:
            if os.getppid() != parent:
                on_death(parent)
                return
            for pid in watched:
                if not alive(pid):
                    on_death(pid)
                    return
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="hvdrunner-watchdog", daemon=True)
    thread.start()
    return thread


JANITOR = [sys.executable, "-m", "airflow_provider_horovod.runner.procs", "--janitor"]


def start_janitor(root: str | None = None) -> subprocess.Popen:
    """Start the janitor of this process's task and session folders in ``root`` (the temp folder):
    they go the moment this process ends, however it ends. Not one of ``spawn``'s children, so
    ``kill_all`` leaves it to clean up after what it kills."""
    import tempfile

    return subprocess.Popen([*JANITOR, str(os.getpid()), root or tempfile.gettempdir()], env=names.children_env(),
                            start_new_session=True, close_fds=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_janitor(janitor: subprocess.Popen) -> None:
    """The task removed its folder itself: its janitor has nothing left to do."""
    with contextlib.suppress(OSError):
        janitor.kill()
    with contextlib.suppress(Exception):
        janitor.wait(timeout=TERM_GRACE_S)


def wait_for_parent_end(pid: int) -> None:
    """Return once ``pid``, this process's parent, has ended: at once through a pidfd (Linux 5.3+),
    else within ``WATCH_INTERVAL_S``. A parent gone already (re-parented) returns at once."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    if fd is not None:
        try:
            if os.getppid() == pid:  # the pidfd is of the parent itself, not a later process with its number
                select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while os.getppid() == pid and alive(pid):
        time.sleep(WATCH_INTERVAL_S)


def working_in(folders: Sequence[str]) -> list[psutil.Process]:
    """This user's processes started for one of ``folders`` (a task's ranks, mpirun, orted, their
    reapers and rsh agent: their environment names the task's plan or a launcher's session folder, orted's)."""
    inside = tuple(os.path.join(f, "") for f in folders)
    found = []
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if proc.pid == os.getpid() or proc.info["uids"].real != os.getuid():
                continue
            env = proc.environ()
            named = (env.get(names.ENV_PLAN, ""), *(os.path.join(env.get(name, ""), "") for name in launchers.session_envs()))
            if any(n.startswith(inside) for n in named if n):
                found.append(proc)
    return found


def janitor(owner: int, root: str) -> int:
    """Wait for ``owner`` (a barrier task, or the driver of local ranks) to end, then remove its
    folders, end what still works in them and remove what they left behind."""
    wait_for_parent_end(owner)
    folders = [os.path.join(root, name) for name in names.sweep_orphans(root, owner=owner)]  # the keys go first
    left = working_in(folders) if folders else []
    for signalled in ("terminate", "kill"):
        for proc in left:
            with contextlib.suppress(psutil.Error):
                getattr(proc, signalled)()
        deadline = time.monotonic() + STOP_GRACE_S  # not psutil.wait_procs: an orphan's zombie counts as ended
        while left and time.monotonic() < deadline:
            left = [p for p in left if alive(p.pid)]
            time.sleep(0.02)
    names.sweep_orphans(root, owner=owner)  # what an ending rank wrote meanwhile
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--janitor"]:
        return janitor(int(argv[1]), argv[2])
    parser = argparse.ArgumentParser(prog="hvdrunner-reaper")
    parser.add_argument("--watch", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    child = spawn(command, dict(os.environ), stdin=subprocess.DEVNULL)

    first = threading.RLock()

    def finish(code: int) -> None:
        # Whichever comes first (the command ends, the task dies, SIGTERM) takes the command's whole
        # session down and ends the reaper at once with its code; nothing here waits on the main
        # thread. A caller on another thread waits for that exit (the watchdog's kill_tree reaps the
        # command, so the main thread's wait() then reads "no such child" as exit code 0). A signal
        # handled while the main thread itself is finishing runs on that same thread: it takes the
        # lock again and finishes, where waiting would wait for itself.
        if not first.acquire(blocking=False):
            threading.Event().wait()
        kill_tree(child.pid if child.poll() is not None else child, grace_s=1.0)
        os._exit(code)

    signal.signal(signal.SIGTERM, lambda *_: finish(143))
    signal.signal(signal.SIGINT, lambda *_: finish(143))
    start_watchdog([args.watch], lambda _pid: finish(143))
    code = child.wait()
    finish(code if code >= 0 else 128 - code)
    return code


if __name__ == "__main__":
    sys.exit(main())
