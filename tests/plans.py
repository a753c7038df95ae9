"""Plans for tests that need one without Spark: task facts as the barrier tasks would report them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner.plan import Plan, TaskFacts, make_plan


def task_facts(partition: int, executor: str = "e:1", **fields: Any) -> TaskFacts:
    """What the task of ``partition`` on ``executor`` reports; ``fields`` override the rest."""
    values: dict[str, Any] = {"address": "10.0.0.%d" % partition, "pid": 100 + partition,
                              "task_dir": "/tmp/p%d" % partition, "python": "3.11.2"}
    values.update(fields)
    return TaskFacts(partition=partition, executor=executor, **values)


def loopback_plan(task_dirs: list[Path], per_host: int = 1, **first: Any) -> Plan:
    """One task per folder on 127.0.0.1, ``per_host`` tasks per executor (a host), each watched by
    this process; ``first``: facts of partition 0 only (its ports)."""
    return make_plan([task_facts(p, "127.0.0.1:%d" % (p // per_host), address="127.0.0.1", pid=os.getpid(),
                                 task_dir=str(d), python="3.11", iface="lo", network="127.0.0.0/8",
                                 **(first if p == 0 else {}))
                      for p, d in enumerate(task_dirs)])
