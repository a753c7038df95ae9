"""Child processes: argv lists only, their own process group, a parent-death watchdog, reaping.

``python -m airflow_provider_horovod.runner.procs --watch PID -- argv...`` is the *reaper*: it
runs ``argv`` in a new session and kills that whole session when ``PID`` (the Spark task that
owns it) disappears or the reaper itself is told to stop. ``mpirun`` and ``orted`` are C programs
with no watchdog of their own, so they always run under a reaper.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import psutil

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


def main(argv: list[str] | None = None) -> int:
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
