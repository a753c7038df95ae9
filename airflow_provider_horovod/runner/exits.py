"""What a user reads when a process ends: a rank's exit in words, its own failure report (its error
file), the last lines of its log, and how a failure crosses Spark in an exception's text. Below every
role: the task side, the launchers, the rank and the driver all read it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import signal
from collections import deque
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.plan import Slot

ERROR_MARKER = "@@HVDRUNNER-ERROR@@"

__all__ = [
    "ERROR_MARKER", "TaskFailure", "exit_text", "failure_blob", "parse_failure", "rank_exit_failure", "rank_tails",
    "read_error_file", "tail", "where",
]


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


def who(slot: Slot | None) -> str:
    """Who a failure's message names: ``Rank 1 on host h (executor 3)``, or ``The job``."""
    if slot is None:
        return "The job"
    return "Rank %d on host %s (executor %s)" % (slot.rank, slot.hostname, slot.executor)


def read_error_file(slot: Slot) -> Failure | None:
    """The failure report the rank of ``slot`` wrote, as a rank may tell it (``Failure.told_by_rank``):
    where it ran is the plan's, when is the file's (the OS's), how it ended is its exit's (the caller's)."""
    path = TaskDir(slot.task_dir).error(slot.rank)
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        told = Failure.from_json(json.loads(path.read_text())).told_by_rank(slot.rank, when=path.stat().st_mtime)
        return told.placed(slot.hostname, slot.executor)
    return None


def rank_exit_failure(slot: Slot, code: int, *, stopping: bool) -> Failure:
    """Why the rank of ``slot`` ended with ``code``: its own report, or one made from its exit.
    ``stopping``: this host ended it (the driver said stop), so it is not a cause of its own."""
    task = TaskDir(slot.task_dir)
    own = read_error_file(slot)
    if own is not None:
        return dataclasses.replace(own, exit=exit_text(code), consequence=stopping)
    how = exit_text(code)
    return Failure(
        message="%s %s%s" % (who(slot), how, " after the job was told to stop" if stopping else ""),
        rank=slot.rank, host=slot.hostname, executor=slot.executor, exit=how,
        tail=tuple(tail(task.rank_log(slot.rank))), consequence=stopping,
    )


def rank_tails(slots: list[Slot]) -> dict[str, list[str]]:
    """The last lines of this host's ranks, from their log files."""
    out = {}
    for slot in slots:
        lines = tail(TaskDir(slot.task_dir).rank_log(slot.rank))
        if lines:
            out[str(slot.rank)] = lines
    return out


class TaskFailure(RuntimeError):
    """Raised in a barrier task (Spark fallback) or the local thread; carries the failure as JSON."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__("%s\n%s" % (failure_blob(failure.to_json()), failure.message))


def failure_blob(raw: dict[str, Any]) -> str:
    """A failure as it travels in an exception's text: first, in markers, as base64 (which holds no
    ``@``): the message after it, which holds a rank's words, cannot forge it (issue 49)."""
    return "%s%s%s" % (ERROR_MARKER, base64.b64encode(json.dumps(raw).encode()).decode(), ERROR_MARKER)


def parse_failure(text: str) -> Failure | None:
    """The failure inside an exception text that travelled through Spark, if there is one: the first
    ``failure_blob`` in it (what follows it, a rank's words included, is never read as one)."""
    start = text.find(ERROR_MARKER)
    end = text.find(ERROR_MARKER, start + len(ERROR_MARKER)) if start >= 0 else -1
    if end < 0:
        return None
    with contextlib.suppress(ValueError, TypeError, AttributeError, binascii.Error):
        return Failure.from_json(json.loads(base64.b64decode(text[start + len(ERROR_MARKER) : end], validate=True)))
    return None
