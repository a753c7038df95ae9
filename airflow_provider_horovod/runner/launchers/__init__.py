"""Launchers: how the ranks of one barrier stage start. One module per launcher, one interface, and
one table of what the rest of the engine may know of a launcher (``LAUNCHERS``).

``mpirun`` (``mpirun.py``, with its rsh agent ``mpirun_rsh.py``), ``gloo`` (``gloo.py``, Horovod's
rendezvous) and ``torch`` (``torch.py``, torchrun's environment contract) each define the same six
functions; the task side (``barrier.py``) and the driver's local ranks call them through
``launcher_of`` and never ask which launcher runs:

- ``serve(spec, partition, executor, address, task, env, client) -> Services``: what this barrier task serves
  the others before any rank starts (its ports go into the task's facts);
- ``host_env(spec) -> dict``: what every process this host starts gets under this launcher;
- ``missing_programs(path) -> tuple``: programs the launcher needs that ``path`` lacks;
- ``warm_env(spec, env, local_size) -> dict``: what the launcher will give a rank of a host with
  ``local_size`` ranks that the training stack reads when it imports (the task's warm process is
  started with it, before the plan: ``rank/warm.py``);
- ``start(spec, plan, partition, task, env, services, client) -> Failure | None``: this task's part
  of the run, to its end (its own rank, or ``mpirun`` for every host);
- ``start_local(spec, plan, task, env) -> Failure | None``: ``np < 0``, every rank on the driver.

What the launchers share on a host (``WORKER`` and ``rank_command``, the warm process's
``start_warm``, ``run_rank_processes``, ``run_reaped``, ``hand_over_key``) is ``processes.py``; a launcher imports nothing of the task side or the driver.

Everything else asks this table (``LAUNCHERS``, one ``LauncherFacts`` per launcher): whether it runs
Horovod (and so whether ``hvd.init()`` is allowed, a timeline exists, Horovod is checked on the
driver and the executors), what its ranks import, the pip extra, the environment names of its
contract (which a rank reads through ``rank_names`` & co, never by name), where its own daemons keep
their session, and what the Horovod view says in place of a timeline. A rank's environment contract
is *set* in its launcher's module (``slot_env`` under Gloo and torch; under mpirun, MPI's own
``OMPI_COMM_WORLD_*``, set by ``orted``, and ``host_env``) and *read* elsewhere only through this
table: ``rank/worker.py``, ``rank/horovod_guard.py``, ``task/rank_states.py``, ``procs.py``,
``names.py`` and ``runtime.py`` ask it. Adding a launcher is a module here and one entry below
(``docs/architecture.md``; ``tests/unit/test_launcher_table.py`` holds it).

This module is a shared one (every role may import it, the rank included): it imports nothing but
the standard library, and names each implementation as a string that ``launcher_of`` imports on
first use (Gloo's imports Horovod, torch's nothing heavy).
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

__all__ = ["LAUNCHERS", "Launcher", "LauncherFacts", "Services", "facts_of", "launcher_of"]


class Launcher(enum.StrEnum):
    """How the ranks are started: ``mpirun`` (the default, as in the original HorovodRunner),
    Horovod's Gloo, or ``torch`` (torch.distributed's own contract, as torchrun sets it: no Horovod).
    A ``str``: JSON, XCom and the task's marker hold the plain word. Each has its entry in
    ``LAUNCHERS`` and its module in this package."""

    MPIRUN = "mpirun"
    GLOO = "gloo"
    TORCH = "torch"

    @property
    def runs_horovod(self) -> bool:
        return LAUNCHERS[self].runs_horovod


@dataclass(frozen=True)
class LauncherFacts:
    """What the engine outside ``launchers/`` knows of one launcher.

    ``contract``: the environment names the launcher's own contract gives a rank, by what they say
    (``rank``, ``size``, ``local_rank``, ``local_size``, ``cross_rank``, ``cross_size``, ``hostname``);
    ``mark``: the name whose presence says a process was started under this launcher's contract.
    """

    name: Launcher
    module: str  # the module implementing the five functions, imported by ``launcher_of``
    runs_horovod: bool  # Horovod runs in the ranks: hvd.init() is allowed, a timeline exists, Horovod is checked
    horovod_controller: str | None  # the controller the driver's Horovod build must have ("MPI", "Gloo")
    rank_modules: tuple[str, ...]  # what the ranks import besides this package (checked on driver and executors)
    extra: str | None  # the pip extra that installs what the ranks import (None: a Horovod build, environment.INSTALL_HINT)
    contract: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    warm_modules: tuple[str, ...] = ()  # what a task's warm process imports before it forks ranks (rank/warm.py)
    # names (``PREFIX*``: every name it starts) this launcher gives a rank that nothing reads while the
    # warm modules import, only after the fork (its daemons', its library's init): they may differ
    # between a rank and its warm process (its contract's names too)
    after_fork_env: tuple[str, ...] = ()
    mark: str | None = None
    forwards_output: bool = False  # a rank's fd 1 is the launcher's pipe (orted): the rank forwards its lines there
    session_env: str | None = None  # names the folder the launcher's own daemons keep their session in (orted)
    contract_never_from_driver: bool = False  # a driver's own values of the contract's names never reach a rank
    no_timeline_hint: str | None = None  # runs no Horovod: where to profile instead (options, the Horovod view)


# What every warm process imports (the worker's own modules), and then the training stack of Horovod's launchers
WARM_WORKER = ("cloudpickle", "psutil", "airflow_provider_horovod.runner.client", "airflow_provider_horovod.runner.plan",
               "airflow_provider_horovod.runner.messages", "airflow_provider_horovod.runtime")
WARM_HOROVOD = (*WARM_WORKER, "torch", "horovod.torch")

LAUNCHERS: dict[Launcher, LauncherFacts] = {
    Launcher.MPIRUN: LauncherFacts(
        name=Launcher.MPIRUN, module=__name__ + ".mpirun", runs_horovod=True, horovod_controller="MPI",
        rank_modules=("cloudpickle", "horovod"), extra=None, warm_modules=WARM_HOROVOD,
        # Open MPI's names (set by orted), then PMIx's and PMI's, as any MPI launcher sets them
        contract={"rank": ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"), "size": ("OMPI_COMM_WORLD_SIZE",),
                  "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",), "local_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",)},
        mark="OMPI_COMM_WORLD_RANK", forwards_output=True, session_env="OMPI_MCA_orte_tmpdir_base",
        # what orted sets for MPI_Init (PWD: its word for the working folder, which the warm process checks itself)
        after_fork_env=("OMPI_*", "PMIX_*", "OPAL_*", "ORTE_*", "PMI_RANK", "PMI_SIZE", "IPATH_NO_BACKTRACE",
                        "HFI_NO_BACKTRACE", "PWD"),
    ),
    Launcher.GLOO: LauncherFacts(
        name=Launcher.GLOO, module=__name__ + ".gloo", runs_horovod=True, horovod_controller="Gloo",
        rank_modules=("cloudpickle", "horovod"), extra=None, warm_modules=WARM_HOROVOD,
        contract={"rank": ("HOROVOD_RANK",), "size": ("HOROVOD_SIZE",), "local_rank": ("HOROVOD_LOCAL_RANK",),
                  "local_size": ("HOROVOD_LOCAL_SIZE",), "cross_rank": ("HOROVOD_CROSS_RANK",),
                  "cross_size": ("HOROVOD_CROSS_SIZE",), "hostname": ("HOROVOD_HOSTNAME",)},
        mark="HOROVOD_RANK",
        # code in the Horovod ecosystem reads "HOROVOD_RANK is set" as "launched with Gloo" (and calls
        # hvd.shutdown() between tests, which ends MPI for good): a driver's own never reaches a rank
        contract_never_from_driver=True,
    ),
    Launcher.TORCH: LauncherFacts(
        name=Launcher.TORCH, module=__name__ + ".torch", runs_horovod=False, horovod_controller=None,
        rank_modules=("cloudpickle", "torch"), extra="torch",
        warm_modules=(*WARM_WORKER, "torch", "torch.distributed"),
        contract={"rank": ("RANK",), "size": ("WORLD_SIZE",), "local_rank": ("LOCAL_RANK",),
                  "local_size": ("LOCAL_WORLD_SIZE",), "cross_rank": ("GROUP_RANK",),
                  "cross_size": ("GROUP_WORLD_SIZE",)},
        mark="TORCHELASTIC_RUN_ID",
        after_fork_env=("MASTER_ADDR", "MASTER_PORT", "ROLE_*", "TORCHELASTIC_*"),  # read by init_process_group
        no_timeline_hint="profile with torch.profiler inside the training function (save its trace under "
                         "runtime.checkpoint_dir() to get it back)",
    ),
}


def facts_of(launcher: Launcher | str) -> LauncherFacts:
    """The table's entry for ``launcher`` (a ``ValueError`` for a word that names none)."""
    return LAUNCHERS[Launcher(launcher)]


def rank_names(*, horovod: bool | None = None) -> tuple[str, ...]:
    """Every name a launcher's contract gives a rank its number by, in the table's order
    (``horovod``: only the launchers that run Horovod, or only those that do not)."""
    return contract_names("rank", horovod=horovod)


def contract_names(what: str, *, horovod: bool | None = None) -> tuple[str, ...]:
    """The names that say ``what`` (``"rank"``, ``"size"``, ...) under each launcher's contract."""
    return tuple(name for facts in LAUNCHERS.values() if horovod is None or facts.runs_horovod == horovod
                 for name in facts.contract.get(what, ()))


def started_under(env: Mapping[str, str], *, horovod: bool | None = None) -> tuple[LauncherFacts, ...]:
    """The launchers whose contract this environment carries (by each one's ``mark``)."""
    return tuple(facts for facts in LAUNCHERS.values() if facts.mark is not None and facts.mark in env
                 and (horovod is None or facts.runs_horovod == horovod))


def forwards_output(env: Mapping[str, str]) -> bool:
    """A rank in ``env`` writes its output to its launcher's pipe as well as to its log (mpirun's orted)."""
    return any(facts.forwards_output for facts in started_under(env))


def session_envs() -> tuple[str, ...]:
    """The names that hold a launcher's own session folder in a process's environment (orted's)."""
    return tuple(facts.session_env for facts in LAUNCHERS.values() if facts.session_env)


def never_from_driver() -> tuple[str, ...]:
    """Contract names a driver's own environment must never pass to a rank, under any launcher."""
    return tuple(name for facts in LAUNCHERS.values() if facts.contract_never_from_driver
                 for names in facts.contract.values() for name in names)


@functools.cache
def after_fork_env() -> tuple[frozenset[str], tuple[str, ...]]:
    """Every launcher's names a rank may hold with another value than its warm process: exact names,
    and prefixes (``after_fork_env`` and every contract name)."""
    words = [w for facts in LAUNCHERS.values() for w in (*facts.after_fork_env, *(n for ns in facts.contract.values() for n in ns))]
    return frozenset(w for w in words if not w.endswith("*")), tuple(w[:-1] for w in words if w.endswith("*"))


def read_after_fork(name: str) -> bool:
    """Whether the environment name ``name`` may differ between a rank and the warm process that forks
    it: nothing reads it while the warm modules import (``rank/warm.py``). The provider's own
    (``HVDRUNNER_*``), Horovod's (``hvd.init()``), the collectives' and CUDA's (their init), and every
    launcher's ``after_fork_env`` and contract. ``OMP_NUM_THREADS`` is *not* one: torch fixes its
    thread count when it is imported (measured: a child forked after ``import torch`` keeps the
    parent's count)."""
    exact, prefixes = after_fork_env()
    return name in exact or name == "CUDA_VISIBLE_DEVICES" or name.startswith(("HVDRUNNER_", "HOROVOD_", "GLOO_", "NCCL_", *prefixes))


def warm_modules(launcher: Launcher | str, payload: bytes = b"") -> tuple[str, ...]:
    """What a task's warm process imports for ``launcher``: the table's ``warm_modules``, less the
    training stack when the payload names TensorFlow or Keras (a rank that trains with them never
    imports torch, and its warm process must not either)."""
    modules = facts_of(launcher).warm_modules
    if b"tensorflow" in payload or b"keras" in payload:
        return WARM_WORKER
    return modules


def no_timeline_hint(launcher: object) -> str | None:
    """What the Horovod view and the options check say in place of a timeline: ``None`` for a launcher
    that runs Horovod (or a word that names no launcher)."""
    try:
        return facts_of(launcher).no_timeline_hint  # type: ignore[arg-type]
    except ValueError:
        return None


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
    return importlib.import_module(facts_of(launcher).module)
