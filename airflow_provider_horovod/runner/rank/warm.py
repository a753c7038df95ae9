"""The warm process of an executor: ``python -m airflow_provider_horovod.runner.rank.warm FD SOCKET
OWNER [IMPORT...]``, a fork server for the ranks of the executor's barrier tasks (``FD``: the socket
``SOCKET``, already listening: the task bound it before it started this process; ``OWNER``: the
executor's pyspark daemon, or the Python worker where there is none, whose end is this process's end).

The first barrier task of an owner that needs it starts it (before the plan) in the owner's folder
for its key, and every later task of that owner uses it, whichever Python worker runs the task
(``launchers/processes.start_warm``), while nothing its imports could have read changed: the
training stack's import (``IMPORT...``: the launcher's ``warm_modules``; ``import torch,
horovod.torch`` is about 1.3 s of CPU) is paid once per executor, and the first time it overlaps
Spark's scheduling, the plan and mpirun's start. A rank's command is then the stub
(``rank/stub.py``), started exactly as the worker was (by the task, or by ``orted``), which connects
to ``SOCKET`` (0600 in its 0700 folder), hands over its descriptors (``SCM_RIGHTS``), its
environment and its folder; this process forks a child that takes them and runs ``MODULE``
(``rank.worker``) as ``python -m MODULE`` would, reports the child's pid, and its exit status when it
ends. An empty request is a task's probe (is it alive?); ``{"stop": true}`` asks it to stop (evicted:
no more ranks, it ends once those it forked have). Whatever this process cannot vouch for gets the
answer ``cold`` and the stub execs the worker itself (a fresh interpreter, as before):

- an environment that differs from this process's own in a name that may be read while the warm
  modules import (``launchers.read_after_fork`` says which names may differ: each is read by the
  worker, ``hvd.init()``/``MPI_Init``, torch.distributed's init or CUDA's first call, all after the
  fork), another interpreter or another working folder;
- CUDA initialised here (never: nothing here calls it, checked before every fork), or a warm import
  that failed;
- a descriptor the rank must have at a number this process already uses.

Why the fork is safe, and what runs at fork time: ``docs/architecture.md`` ("Warm rank processes").
This process runs no thread of its own (one ``selectors`` loop), dies with its owner (a pidfd of
``OWNER`` in the loop; with ``np < 0`` the run also kills it in its ``finally``), and SIGKILLs a
child's whole tree the moment that child's stub goes away (``kill_tree`` SIGKILLs the stub after its grace).
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.launchers import read_after_fork

__all__ = ["differing_names", "main"]

MAX_REQUEST = 1 << 20
WORKER_MODULE = "airflow_provider_horovod.runner.rank.worker"  # what every child runs, as ``python -m`` would
STOP_SIGNAL = signal.SIGKILL  # a child whose stub is gone: nothing of it may outlive the stub


def differing_names(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The names that keep a rank with environment ``theirs`` from being forked here: set in one and
    not the other, or set to another value, and not read only after the fork."""
    keys = set(mine) ^ set(theirs) | {k for k in set(mine) & set(theirs) if mine[k] != theirs[k]}
    return sorted(k for k in keys if not read_after_fork(k))


def _say(text: str) -> None:
    sys.stderr.write("%s warm[%d]: %s\n" % (time.strftime("%H:%M:%S"), os.getpid(), text))
    sys.stderr.flush()


def _warm_up(modules: list[str]) -> str | None:
    """Import the training stack; ``None``, or why this process cannot fork ranks."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any failure means: every rank starts cold
            return "import %s failed: %s: %s" % (module, type(err).__name__, err)
    return None


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch that cannot say: do not fork
        return True


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a length, JSON (argv, env, cwd, the fd numbers) and the descriptors themselves."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(64 * fds.itemsize))
    for level, kind, body in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(body[: len(body) - (len(body) % fds.itemsize)])
    received = list(fds)
    if not data and not received:
        raise EOFError  # a task's probe (``launchers/processes.probe``): connected, and gone
    if len(data) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", data[:4])
    if size > MAX_REQUEST:
        raise ValueError("request too large")
    body = data[4:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("request cut off")
        body += chunk
    return json.loads(body), received


class Server:
    def __init__(self, path: str, owner: int, module: str, refusal: str | None) -> None:
        self.path = path
        self.owner = owner
        self.module = module
        self.refusal = refusal
        self.sel = selectors.DefaultSelector()
        self.children: dict[socket.socket, tuple[int, int]] = {}  # stub's connection -> (child pid, its pidfd)
        self.listener: socket.socket | None = None
        self.owner_fd = -1
        self.stopping = False  # asked to stop (evicted): no more ranks; ends once its children have

    # -- the decision ---------------------------------------------------------------------------
    def why_cold(self, request: dict, received: list[int], conn: socket.socket) -> str | None:
        if self.refusal:
            return self.refusal
        if request.get("argv", [None])[0] != sys.executable:
            return "another interpreter (%s)" % request.get("argv", [None])[0]
        if request.get("cwd") != os.getcwd():
            return "another working folder (%s)" % request.get("cwd")
        differ = differing_names(dict(os.environ), request.get("env", {}))
        if differ:
            return "the environment differs in %s" % ", ".join(differ)
        if len(received) != len(request.get("fds", ())):
            return "descriptors missing"
        busy = set(map(int, os.listdir("/proc/self/fd"))) - self.own_fds(conn) - set(received)
        taken = [n for n in request["fds"] if n > 2 and n in busy]  # held by an imported module
        if taken:
            return "descriptor %s is in use here" % taken
        if _cuda_initialised():
            return "CUDA is initialised in the warm process"
        return None

    # -- the loop -------------------------------------------------------------------------------
    def serve(self, listener: socket.socket) -> tuple | str:
        """Answer requests until the owner ends (``"owner"``) or, asked to stop, its last child has
        (``"stopped"``). Returns in a forked child only: what it must run."""
        self.listener = listener
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        try:
            self.owner_fd = os.pidfd_open(self.owner)
        except ProcessLookupError:
            return "owner"
        self.sel.register(self.owner_fd, selectors.EVENT_READ, "owner")
        while not (self.stopping and not self.children):
            for key, _ in self.sel.select():
                what = key.data
                if what == "owner":
                    self.stop_all()
                    return "owner"
                if what == "accept":
                    job = self.accept()
                    if job is not None:
                        return job
                elif what[0] == "stub":  # the stub hung up (it died: SIGKILL) before its child ended
                    self.stub_gone(what[1])
                elif what[0] == "child":
                    self.child_ended(what[1])
        return "stopped"

    def accept(self) -> tuple | None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(5.0)
            request, received = _receive(conn)
        except EOFError:
            conn.close()
            return None
        except (OSError, ValueError) as err:
            _say("a request could not be read: %s" % err)
            conn.close()
            return None
        if request.get("stop"):  # evicted (``launchers/processes._evict``): its folder is gone already
            conn.close()
            for fd in received:
                os.close(fd)
            self.stop_accepting()
            return None
        why = self.why_cold(request, received, conn)
        if why is not None:
            _say("rank %s starts cold: %s" % (names.rank_of(request.get("env", {})), why))
            with contextlib.suppress(OSError):
                conn.sendall(b"cold\n")
            for fd in received:
                os.close(fd)
            conn.close()
            return None
        rank = names.rank_of(request["env"])
        pid = os.fork()
        if pid == 0:
            self.close_in_child(conn)
            return request, received
        for fd in received:
            os.close(fd)
        folder = request.get("task_dir") or ""
        if rank is not None and os.path.isdir(folder):  # the rank's task folder: its stall report reads it
            with contextlib.suppress(OSError):
                tmp = os.path.join(folder, (names.RANK_PID % rank) + ".tmp")
                with open(tmp, "w") as f:
                    f.write(str(pid))
                os.replace(tmp, os.path.join(folder, names.RANK_PID % rank))
        pidfd = os.pidfd_open(pid)
        self.children[conn] = (pid, pidfd)
        conn.setblocking(True)
        self.sel.register(conn, selectors.EVENT_READ, ("stub", conn))
        self.sel.register(pidfd, selectors.EVENT_READ, ("child", conn))
        with contextlib.suppress(OSError):
            conn.sendall(b"pid %d\n" % pid)
        _say("rank %s forked as pid %d" % (rank, pid))
        return None

    def child_ended(self, conn: socket.socket) -> None:
        pid, pidfd = self.children.pop(conn)
        _, status = os.waitpid(pid, 0)
        self.sel.unregister(pidfd)
        with contextlib.suppress(KeyError):  # unregistered already when its stub went first
            self.sel.unregister(conn)
        os.close(pidfd)
        with contextlib.suppress(OSError):
            conn.sendall(b"exit %d\n" % status)
        conn.close()

    def stub_gone(self, conn: socket.socket) -> None:
        pid, _pidfd = self.children[conn]
        _say("the stub of pid %d went away: killing its tree" % pid)
        self.sel.unregister(conn)  # its hang-up stays readable: the child's pidfd says when it is gone
        self.kill_tree(pid)

    @staticmethod
    def kill_tree(pid: int) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.send_signal(STOP_SIGNAL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, STOP_SIGNAL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STOP_SIGNAL)

    def stop_accepting(self) -> None:
        """No more ranks: whoever is still in the backlog gets no answer and starts cold; the ranks
        already forked run on (another task's), and this process ends once they have."""
        _say("asked to stop: %d rank(s) still running" % len(self.children))
        self.stopping = True
        self.sel.unregister(self.listener)
        self.listener.close()

    def stop_all(self) -> None:
        for pid, _ in list(self.children.values()):
            self.kill_tree(pid)

    def own_fds(self, conn: socket.socket) -> set[int]:
        """What ``close_in_child`` closes: a rank may have its descriptors at these numbers."""
        fds = {self.sel.fileno(), self.listener.fileno(), self.owner_fd, conn.fileno()}
        for other, (_pid, pidfd) in self.children.items():
            fds |= {other.fileno(), pidfd}
        return fds

    def close_in_child(self, keep: socket.socket) -> None:
        """The child keeps nothing of the server: its listener, its selector, the other stubs'
        connections (or their hang-up would never be seen), the pidfds."""
        self.sel.close()
        if self.listener.fileno() >= 0:
            self.listener.close()
        for conn, (_pid, pidfd) in self.children.items():
            conn.close()
            os.close(pidfd)
        if self.owner_fd >= 0:
            os.close(self.owner_fd)
        keep.close()


def _become(request: dict, received: list[int], module: str) -> None:
    """In the forked child: take the stub's descriptors, environment and folder, then run ``module``
    as ``python -m module`` would (``SystemExit`` and the interpreter's normal end follow, atexit included)."""
    import runpy

    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    targets = [int(n) for n in request["fds"]]
    high = max([*targets, *received, 2]) + 1
    moved = [_dup_above(fd, high) for fd in received]  # out of the way of every target first
    for fd in received:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    cwd = os.getcwd()
    if sys.path and sys.path[0] != cwd and os.path.isabs(sys.path[0] or "."):
        sys.path[0] = cwd
    sys.argv = [request["argv"][0]]
    _show_as(request["argv"][-3:])
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _show_as(argv: list[str]) -> None:
    """Show the cold command (``python -m ...rank.worker``) as this process's command line (``ps``,
    ``/proc/PID/cmdline``), as ``setproctitle`` does: written over the process's original argv, which
    the interpreter copied at its start and never reads again. Left as it is if it does not fit."""
    import ctypes

    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat(5)
        text = "\0".join(argv).encode() + b"\0"
        if start and len(text) <= end - start:
            ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)


def _dup_above(fd: int, lowest: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd, path, owner, *modules = argv
    module = WORKER_MODULE
    listener = socket.socket(fileno=int(fd))  # bound to ``path`` (0600) and listening: a stub that comes
    os.set_inheritable(listener.fileno(), False)  # while the modules import waits in the backlog
    began = time.monotonic()
    refusal = _warm_up(modules)
    # What the imports made lives as long as this process and every rank forked from it: out of the
    # collector's sight from now on (gc.freeze, as Python's docs advise a fork server), so a rank's
    # collections, its exit's included, never walk it, nor write to the pages it shares with this process.
    gc.freeze()
    _say("imported %s in %.2f s%s" % (" ".join(modules) or "nothing", time.monotonic() - began,
                                        "" if refusal is None else "; every rank starts cold: " + refusal))
    job = Server(path, int(owner), module, refusal).serve(listener)
    if job == "stopped":  # evicted: its folder was moved aside and removed by the task that asked
        return 0
    if job == "owner":  # the owner ended (no task of it can start one under its name now): its folder goes with it
        folder = os.path.dirname(path)
        if os.path.basename(folder).startswith(names.WARM_DIR_PREFIX.split("%", 1)[0]):
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return 0
    request, received = job
    try:
        _become(request, received, module)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - what python -m would print
        traceback.print_exc()
        raise SystemExit(1) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
