"""The rank process: ``python -m airflow_provider_horovod.runner.rank.worker``.

Started by a barrier task (Gloo, torch) or by ``orted`` (mpirun), with its launcher's environment. It finds its slot in the plan, arms
a parent-death watchdog, captures its own stdout/stderr (file descriptors, so C++ output too) and
streams the lines to the driver, unpickles the training function and calls it. Rank 0 writes its
return value next to its task; a rank that raises reports its traceback and exits non-zero.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from airflow_provider_horovod.runner.messages import Error, Logs
from airflow_provider_horovod.runner.names import TAIL_LINES

FLUSH_INTERVAL_S = 0.2  # how often new lines go to the driver
FOLLOW_INTERVAL_S = 0.1  # how often the log file is read for new lines (a wake-up beside training: rare)


def _rank() -> int:
    """The task's word (``HVDRUNNER_RANK``, Gloo and torch), else the launcher's own (MPI's, set by
    orted under mpirun): every name the launchers' table lists for a rank."""
    from airflow_provider_horovod.runner.launchers import rank_names
    from airflow_provider_horovod.runner.names import ENV_RANK

    for name in (ENV_RANK, *rank_names()):
        if os.environ.get(name):
            return int(os.environ[name])
    raise RuntimeError("the rank process was started without %s or any of %s" % (ENV_RANK, ", ".join(rank_names())))


class OutputPump:
    """The rank's fds 1 and 2 write straight into its log file next to the task (``O_APPEND``), so
    nothing it printed is lost when it dies abruptly; a thread follows the file and sends the lines
    to the driver (and, under mpirun, to orted's stdout, as under ``horovodrun``).

    ``stream``: every line is shown in the driver's log; otherwise lines still travel, quietly, so
    the driver has every rank's last lines for a failure report.
    """

    def __init__(self, rank: int, client, stream: bool, log_path: Path, forward: bool) -> None:
        self.rank = rank
        self.client = client
        self.stream = stream
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._forward = os.dup(1) if forward else None
        sys.stdout.flush()
        sys.stderr.flush()
        if forward:  # under mpirun fd 1 is orted's pipe; a Gloo rank's fds 1 and 2 are the file already
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        self._file = open(log_path, "rb")  # noqa: SIM115 - read by the follower thread until close()
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        buf = b""
        last_flush = time.monotonic()
        while True:
            chunk = self._file.read(65536)
            if chunk:
                if self._forward is not None:
                    with contextlib.suppress(OSError):
                        os.write(self._forward, chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._line(line)
            elif self._closing.is_set():
                if buf:
                    self._line(buf)
                self._flush()
                return
            else:
                self._closing.wait(FOLLOW_INTERVAL_S)  # close() wakes it: the last lines go at once
            if time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                self._flush()
                last_flush = time.monotonic()

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        with self._lock:
            self.tail.append(line)
            self._pending.append(line)

    def _flush(self) -> None:
        with self._lock:
            lines, self._pending = self._pending, []
        if lines and self.client is not None:
            for batch in Logs.batches(self.rank, lines, quiet=not self.stream):
                self.client.send(batch)

    def close(self) -> None:
        """Send everything printed so far (bounded wait). What the interpreter prints while it
        shuts down still lands in the log file, for the host's failure report."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._closing.set()
        self._reader.join(1.0)


def _die(_pid: int) -> None:
    # The task (or orted) that owns this rank is gone: take down what this rank started, then exit.
    import psutil

    with contextlib.suppress(Exception):
        for child in psutil.Process().children(recursive=True):
            child.kill()
    os._exit(137)


def _take_key(path: Path) -> bytes:
    """This rank's channel key, from the file its task left for it; the file goes once read."""
    try:
        key = bytes.fromhex(path.read_text())
    except (OSError, ValueError):
        return b""
    with contextlib.suppress(OSError):
        path.unlink()
    return key


def _setup(rank: int):
    """Find this rank's slot, arm the watchdog, connect to the driver, capture the output."""
    from airflow_provider_horovod import runtime
    from airflow_provider_horovod.runner import launchers, names
    from airflow_provider_horovod.runner.client import ChannelClient
    from airflow_provider_horovod.runner.plan import Plan, rank_env
    from airflow_provider_horovod.runner.procs import start_watchdog
    from airflow_provider_horovod.runner.wire import Credentials, rank_role

    plan = Plan.from_json(Path(os.environ[names.ENV_PLAN]).read_text())
    slot = plan.slots[rank]
    start_watchdog([slot.task_pid], _die)
    task = names.TaskDir(slot.task_dir)
    key = _take_key(task.rank_key(rank))
    host, _, port = os.environ.get(names.ENV_CHANNEL, "").rpartition(":")
    client = ChannelClient((host, int(port)) if port and key else None, Credentials(rank_role(rank), key))
    runtime._client = client
    if client.connected and os.environ.get(names.ENV_STALL_WATCH) != "0":  # the stall rule's pulse, before anything slow
        from airflow_provider_horovod.runner.rank.stacks import Watch

        runtime._watch = Watch(client, float(os.environ.get(names.ENV_STALL_TIMEOUT, "600")))
    if rank == 0 and client.connected:
        from airflow_provider_horovod.runner.rank.reports import Reporter

        runtime._reporter = Reporter(client)
    pump = OutputPump(rank, client, stream=os.environ.get(names.ENV_VERBOSITY, "all") == "all",
                      log_path=task.rank_log(rank), forward=launchers.forwards_output(os.environ))
    os.environ.update(rank_env(slot))
    os.environ[names.ENV_TASK_DIR] = slot.task_dir
    if os.environ.get(names.ENV_HAS_RESUME) == "1":
        # one copy per host, fetched by the host's first task
        os.environ[names.ENV_RESUME_DIR] = str(names.TaskDir(plan.host_leader(slot.hostname).task_dir).resume)
    if os.environ.get(names.ENV_TIMELINE) == "1":
        # Every rank must have it set or Horovod's ranks disagree and hang; only rank 0 writes
        # into the folder that comes back.
        folder = task.rank_folder(rank)
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["HOROVOD_TIMELINE"] = str(folder / names.TIMELINE_FILE)
    if rank == 0:  # commit_checkpoint's code, loaded beside the training's start, not in its first call
        threading.Thread(target=importlib.import_module, args=("airflow_provider_horovod.runner.task.shipper",),
                         name="hvdrunner-preload", daemon=True).start()
    return slot, task, client, pump


def _report(rank: int, slot, task, client, pump, err: BaseException) -> None:
    """Write and send this rank's failure: its exception, traceback and last lines."""
    from airflow_provider_horovod.exceptions import provider_class_name
    from airflow_provider_horovod.runner.events import Failure
    from airflow_provider_horovod.runner.exits import who

    text = traceback.format_exc()
    sys.stderr.write(text)
    exception = "%s: %s" % (type(err).__name__, err)
    _close_reports()
    if pump is not None:
        pump.close()
    failure = Failure(message="%s failed: %s" % (who(slot) if slot else "Rank %d" % rank, exception), rank=rank,
                      host=getattr(slot, "hostname", None), executor=getattr(slot, "executor", None),
                      exception=exception, traceback=text, tail=tuple(pump.tail) if pump is not None else (),
                      error_class=provider_class_name(err))
    if task is not None:
        with contextlib.suppress(OSError):
            task.error(rank).write_text(json.dumps(failure.to_json()))
    if client is not None:
        client.send_now(Error(failure))
        client.close()


def _close_reports() -> None:
    """Rank 0's last report goes before the rank's end does; the stall watch says the rank is done."""
    from airflow_provider_horovod import runtime

    if runtime._reporter is not None:
        runtime._reporter.close()
    if runtime._watch is not None:
        runtime._watch.close()


def _before_main() -> None:
    """What this rank's launcher asks of every rank before the training function (its slot's
    ``HVDRUNNER_BEFORE_MAIN``, ``module:function``), if anything."""
    import importlib

    from airflow_provider_horovod.runner.names import ENV_BEFORE_MAIN

    module, _, function = os.environ.get(ENV_BEFORE_MAIN, "").partition(":")
    if module:
        getattr(importlib.import_module(module), function)()


def _pickled_result(result: object) -> bytes:
    """Rank 0's return value, pickled; a ``PayloadError`` that says what to return instead."""
    import cloudpickle

    from airflow_provider_horovod.exceptions import PayloadError

    try:
        return cloudpickle.dumps(result)
    except Exception as err:
        raise PayloadError(
            "Rank 0's return value (a %s) cannot be pickled, so it cannot travel back to the driver (%s: %s). "
            "Return plain data (numbers, strings, lists, dicts, numpy arrays, CPU tensors), or save the object "
            "under runtime.checkpoint_dir() (it comes back with the artifacts) and return its file name."
            % (type(result).__qualname__, type(err).__name__, err)
        ) from err


def main() -> int:
    rank = _rank()
    slot = task = client = pump = None
    try:
        slot, task, client, pump = _setup(rank)
        from airflow_provider_horovod.runner.rank import horovod_guard, keras_guard
        from airflow_provider_horovod.runner.names import ENV_PAYLOAD
        from airflow_provider_horovod.runner.payload import load_payload

        keras_guard.install()  # before unpickling can import horovod.tensorflow.keras
        horovod_guard.install()  # launcher="torch": hvd.init() would make a world of one
        _before_main()
        fn, args, kwargs = load_payload(Path(os.environ[ENV_PAYLOAD]).read_bytes())
        result = fn(*args, **kwargs)
        if rank == 0:
            tmp = task.result.with_name(task.result.name + ".tmp")
            tmp.write_bytes(_pickled_result(result))
            os.replace(tmp, task.result)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the driver
        _report(rank, slot, task, client, pump, err)
        os._exit(1)
    _close_reports()
    pump.close()
    client.close()
    _freeze_for_exit()
    return 0


def _freeze_for_exit() -> None:
    """The rank's work is done: what is garbage now is collected (finalizers run), and what is left
    is frozen, so the interpreter's shutdown frees it by reference counting without its collections
    walking the training stack's objects again: with torch and Horovod imported, those collections
    took 0.5 cpu-s of a 0.75 s exit, per rank. Non-daemon threads, atexit handlers and the modules'
    teardown still run as in any exit (CPython promises no finalizer of an object still alive at exit)."""
    import gc

    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
