"""Launchers: how the ranks of one barrier stage start. One module per launcher, one interface.

``mpirun`` (``mpirun.py``, with its rsh agent ``mpirun_rsh.py``), ``gloo`` (``gloo.py``, Horovod's
rendezvous) and ``torch`` (``torch.py``, torchrun's environment contract) each define the same five
functions; the task side (``barrier.py``) and the driver's local ranks call them through
``launcher_of`` and never ask which launcher runs:

- ``serve(spec, partition, executor, address, task, env, client) -> Services``: what this barrier task serves
  the others before any rank starts (its ports go into the task's facts);
- ``host_env(spec) -> dict``: what every process this host starts gets under this launcher;
- ``missing_programs(path) -> tuple``: programs the launcher needs that ``path`` lacks;
- ``start(spec, plan, partition, task, env, services, client) -> Failure | None``: this task's part
  of the run, to its end (its own rank, or ``mpirun`` for every host);
- ``start_local(spec, plan, task, env) -> Failure | None``: ``np < 0``, every rank on the driver.

What the launchers share on a host (``WORKER``, ``run_rank_processes``, ``run_reaped``,
``hand_over_key``) is ``processes.py``; a launcher imports nothing of the task side or the driver.

A rank's environment contract is set in its launcher's module, nowhere else: ``slot_env`` under Gloo
and torch; under mpirun, MPI's own (``OMPI_COMM_WORLD_*``, set by ``orted``) and ``host_env``. Its
names are still read outside ``launchers/`` where a process asks which rank it is or runs:
``rank/worker.py`` (``_rank``, mpirun's output forwarding), ``rank/horovod_guard.py``,
``task/rank_states.py``, ``procs.py`` (orted's session folder) and ``runtime.py``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from airflow_provider_horovod.runner.options import Launcher

__all__ = ["Services", "launcher_of"]


class Services:
    """What one barrier task serves to the other tasks while the ranks start (nothing, here)."""

    def ports(self) -> dict[str, int | tuple[int, ...]]:
        """The ports the plan must know (``TaskFacts`` fields by name)."""
        return {}

    def expect(self, plan, partition: int) -> None:
        """The plan is known: serve exactly what it needs."""

    def close(self) -> None:
        """The task ends: stop serving."""


def launcher_of(launcher: Launcher | str) -> ModuleType:
    """The module of ``launcher`` (imported on first use: Gloo's imports Horovod, torch's nothing heavy)."""
    return importlib.import_module("%s.%s" % (__name__, Launcher(launcher).value))
