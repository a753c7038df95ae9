"""A barrier task asked to terminate (SIGTERM) gives the same notice as Spark's decommission.

SIGTERM reaches a task's process when its container or job is taken back: YARN preempting a
container (SIGTERM to its processes, SIGKILL 250 ms later by default), a batch scheduler ending a
job or draining a node (Slurm's ``KillWait``: 30 s), an operator's ``kill``. The task then, at once:

- tells its own ranks (``announce``: ``runtime.preempting()`` turns true there), as it does when the
  driver tells it of a decommission (``barrier.py``);
- tells the driver (a ``terminating`` event), which tells every other task of the attempt, as it
  does for a decommissioned executor, and waits ``preempt_grace_s`` for rank 0's version before the
  restart resumes from the newest one;
- lives on ``grace_s`` at most for rank 0 to commit that version, then says why it ends (lost
  infrastructure, which restarts the run within ``max_restarts``), ends its ranks, removes its
  folder and ends itself by SIGTERM, as it was asked. A second SIGTERM ends it at once.

The ranks run in sessions of their own (``procs``): a SIGTERM sent to the task's process group
reaches the task only, which ends them when it goes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from airflow_provider_horovod.runner import messages, names, procs
from airflow_provider_horovod.runner.events import Failure

CLEANUP_S = 3.0  # after the grace and its ranks' end, how long the task has to remove its folder


def announce(task_dir: str | Path) -> None:
    """Every rank of this task is told that the attempt is about to lose an executor: the flag
    ``runtime.preempting()`` reads (``rank/preemption.py``); a second notice changes nothing."""
    with contextlib.suppress(OSError):
        names.TaskDir(task_dir).preempting.touch()


class SigtermNotice:
    """From its construction to ``close()`` (the task's last step): SIGTERM is a preemption notice,
    and the end of the task ``grace_s`` later at most. ``close()`` puts back the handler before.

    Only in the process's main thread (where Python runs signal handlers); elsewhere nothing changes.
    """

    def __init__(self, client, task_dir: Path, partition: int, executor: str, grace_s: float) -> None:
        self.told = threading.Event()
        self._client = client
        self._partition, self._executor, self._grace_s = partition, executor, grace_s
        self._closed = threading.Event()
        self._installed = False
        self._previous: object = signal.SIG_DFL
        self._timer = threading.Timer(grace_s, self._end)
        self._timer.daemon = True
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(_signum, _frame) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the task at once
            if getattr(client, "stopped", None) is not None and client.stopped.is_set():
                _die()  # the driver is ending the attempt (Spark without its daemon kills workers by SIGTERM)
            self.told.set()
            announce(task_dir)
            client.send(messages.Event("terminating", partition=partition, executor=executor))
            self._timer.start()

        self._previous = signal.signal(signal.SIGTERM, on_sigterm)
        self._installed = True

    def _end(self) -> None:
        """``grace_s`` after the SIGTERM: the driver hears why (lost infrastructure: the run restarts),
        the ranks end, and the task ends once it has cleaned up (``close``), or a moment later
        whatever it is doing."""
        self._client.send(messages.Error(Failure(
            "The barrier task of partition %d (executor %s) was told to terminate (SIGTERM) and ended its ranks "
            "preempt_grace_s=%gs later" % (self._partition, self._executor, self._grace_s),
            executor=self._executor, exit="was killed by SIGTERM")))
        procs.kill_all()
        self._closed.wait(CLEANUP_S)
        _die()

    def close(self) -> None:
        """The task is over. Without a SIGTERM, the handler before is back; after one, SIGTERM keeps
        its default action: a task whose ranks ended within the grace returns its result as usual,
        and the grace's end, if it comes first, ends it."""
        self._closed.set()
        if self._installed and not self.told.is_set():
            self._timer.cancel()
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


def _die() -> None:
    """End this process as SIGTERM asked: its default action is back since the first one came
    (``on_sigterm``); from any thread."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)  # a handler someone installed since: SIGTERM did not end it
