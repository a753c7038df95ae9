"""What the OS says of this task's rank processes, looked at when the driver says stop and before
they are killed: the stall rule names a silent rank with it (``driver/stalls.py``).

A task looks only at its own descendants (the ranks it started, or that its ``orted`` started),
found by their command line; a rank's number comes from its environment, as its launcher set it. A
rank forked by a warm process (``rank/warm.py``) shows its warm process's command line and
environment, so it is found through its stub (which has the rank's own): the warm process wrote the
pid it forked for that rank in the rank's task folder (``rank-N.pid``), and what is reported is that
process, the one that trains.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from airflow_provider_horovod.runner import launchers, names

_WORKER = "airflow_provider_horovod.runner.rank.worker"
_STUB = "airflow_provider_horovod.runner.rank.stub"
_RANK_ENV = (names.ENV_RANK, *launchers.rank_names())  # the task's word, else each launcher's contract


def snapshot(root: int | None = None) -> dict[str, dict[str, Any]]:
    """``{"1": {"pid": 42, "status": "stopped"}}`` for every rank process below ``root`` (this process)."""
    states: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error, ValueError):
                if _WORKER not in proc.cmdline():
                    continue
                env = proc.environ()
                rank = next((env[k] for k in _RANK_ENV if env.get(k, "").isdigit()), None)
                if rank is None:
                    continue
                if _STUB in proc.cmdline():
                    proc = _forked(env, int(rank)) or proc
                states[rank] = {"pid": proc.pid, "status": proc.status()}
    return states


def _forked(env: dict[str, str], rank: int) -> psutil.Process | None:
    """The process a warm process forked for ``rank`` (its stub's environment names the plan)."""
    from airflow_provider_horovod.runner.plan import Plan

    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, psutil.Error):
        slot = Plan.from_json(open(env[names.ENV_PLAN]).read()).slots[rank]
        pid = int(names.TaskDir(slot.task_dir).rank_pid(rank).read_text())
        proc = psutil.Process(pid)
        if _WORKER in proc.cmdline() and _STUB not in proc.cmdline():
            return proc
    return None


def report(client, partition: int) -> None:
    """Send this task's snapshot to the driver before its ranks are killed (bounded wait)."""
    from airflow_provider_horovod.runner.messages import RankStates

    states = snapshot()
    if states:
        client.send_now(RankStates(partition, states), timeout=1.0)
