"""What the OS says of this task's rank processes, looked at when the driver says stop and before
they are killed: the stall rule names a silent rank with it (``driver/stalls.py``).

A task looks only at its own descendants (the ranks it started, or that its ``orted`` started),
found by their command line; a rank's number comes from its environment, as its launcher set it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from airflow_provider_horovod.runner import launchers, names

_WORKER = "airflow_provider_horovod.runner.rank.worker"
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
                if rank is not None:
                    states[rank] = {"pid": proc.pid, "status": proc.status()}
    return states


def report(client, partition: int) -> None:
    """Send this task's snapshot to the driver before its ranks are killed (bounded wait)."""
    from airflow_provider_horovod.runner.messages import RankStates

    states = snapshot()
    if states:
        client.send_now(RankStates(partition, states), timeout=1.0)
