"""A rank's command when its task has a warm process: ``python -m airflow_provider_horovod.runner.rank.stub
python -m airflow_provider_horovod.runner.rank.worker`` (the stub, then the cold command).

Started exactly as the worker would be (by the task under Gloo and torch, by ``orted`` under mpirun,
same environment, descriptors and folder), it asks its task's warm process (``rank/warm.py``, at
``warm.sock`` in the folder of its rank's task, found through the plan) to fork the rank with its
descriptors, environment and folder, then stands in for it: the signals a launcher sends a rank
(TERM, INT, HUP, QUIT, USR1, USR2, CONT) go on to the rank, and the stub ends as the rank ended, with
its exit code or killed by its signal, so what the launcher sees is the rank's own end. If the stub
is killed (SIGKILL), the warm process kills the rank's tree at once.

Whatever goes wrong before the fork (no warm process, an answer ``cold``, no answer within
``WAIT_S``) ends in ``exec`` of the cold command: the same pid, a fresh interpreter, as without a
warm process. Standard library and the launchers' table only (no third-party import).
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

WAIT_S = 60.0  # for the warm process's answer (it answers once its imports are done): then cold
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def cold(command: list[str]) -> None:
    os.execv(command[0], command)


def task_dir() -> str | None:
    """The folder of this rank's task (under mpirun, not always the task whose ``orted`` started this
    process): the plan names it. Its ``warm.sock`` leads to the warm process."""
    from airflow_provider_horovod.runner.names import ENV_PLAN, rank_of

    rank = rank_of(os.environ)
    try:
        with open(os.environ[ENV_PLAN]) as f:
            slots = json.load(f)
        return slots[rank]["task_dir"]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return None


def _open_fds(skip: int) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        fds.append(fd)
    return sorted(fds)


def _ask(sock: socket.socket, command: list[str], folder: str) -> None:
    fds = _open_fds(sock.fileno())
    body = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                       "task_dir": folder}).encode()
    data = struct.pack("!I", len(body)) + body
    sent = sock.sendmsg([data[:4096]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(data[sent:])


def _line(reader) -> str:
    line = reader.readline()
    if not line:
        raise EOFError
    return line.decode().strip()


def _end_as(status: int) -> None:
    """End this process as the rank ended: its code, or its signal (default action, on itself)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # whose disposition cannot be set (EINVAL)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str] | None = None) -> int:
    from airflow_provider_horovod.runner.names import WARM_SOCKET

    command = sys.argv[1:] if argv is None else argv
    folder = task_dir()
    path = os.path.join(folder, WARM_SOCKET) if folder else None
    if path is None or not os.path.exists(path):
        cold(command)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(WAIT_S)
        sock.connect(path)
        _ask(sock, command, folder)
        reader = sock.makefile("rb")
        answer = _line(reader)
    except (OSError, EOFError, ValueError):
        answer = "cold"
    if not answer.startswith("pid "):
        sock.close()
        cold(command)
    pid = int(answer.split()[1])

    def forward(signum, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it ended: its status is on its way

    for sig in FORWARDED:
        signal.signal(sig, forward)
    sock.settimeout(None)
    try:
        status = int(_line(reader).split()[1])
    except (OSError, EOFError, ValueError, IndexError):
        status = signal.SIGKILL  # the warm process died under its rank: the rank went with it (its watchdog)
    _end_as(status)
    return 1


if __name__ == "__main__":
    sys.exit(main())
