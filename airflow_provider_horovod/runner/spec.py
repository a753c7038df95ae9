"""The run's spec: everything a barrier task needs, made by the driver's attempt and pickled into the
barrier stage's closure (``task/barrier.py`` runs it; the launchers read their part of it)."""

from __future__ import annotations

import dataclasses

from airflow_provider_horovod.runner.dataset import DatasetSpec
from airflow_provider_horovod.runner.launchers import Launcher
from airflow_provider_horovod.runner.options import DEFAULT_STALL_TIMEOUT_S

__all__ = ["RunSpec"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a barrier task needs; pickled into the task's closure (never shown in Spark's UI)."""

    run_id: str
    secret: bytes = dataclasses.field(repr=False)
    payload: bytes = dataclasses.field(repr=False)
    launcher: Launcher
    verbosity: str
    channel: tuple[str, int] | None
    env: dict[str, str] = dataclasses.field(repr=False)
    driver_python: str
    driver_stack: dict[str, str] = dataclasses.field(default_factory=dict)  # environment.stack_of_this_host()
    gloo_timeout_s: int = 60
    stall_timeout_s: int = int(DEFAULT_STALL_TIMEOUT_S)  # Horovod's stall shutdown (``horovod_stall.stall_env``)
    timeline: bool = False
    collect_artifacts: bool = False
    has_resume: bool = False
    resume_local: str | None = None  # np < 0: the folder itself, on the driver
    dataset: DatasetSpec | None = None  # dataset=: each task spills its partition for its rank
    attempt: int = 0  # which attempt of the run (runtime.attempt())
    max_restarts: int = 0  # the run's max_restarts (torch's TORCHELASTIC_MAX_RESTARTS)
    preempt_grace_s: float = 10.0  # a task told to terminate (SIGTERM) lives this long at most (``termination``)
