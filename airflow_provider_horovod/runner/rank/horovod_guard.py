"""Horovod is refused in a rank that torch.distributed's launcher started.

``launcher="torch"`` gives each rank torchrun's environment contract (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``TORCHELASTIC_RUN_ID``, ...) and none of Horovod's (no ``HOROVOD_RANK``, no MPI
world). ``hvd.init()`` kept in such code does not fail: Horovod makes every rank a world of one, so
``hvd.allreduce`` and ``hvd.DistributedOptimizer`` average nothing and each rank trains its own model
to a "successful" end. Horovod does the same under a bare ``torchrun``.

Why an import hook in the rank process (as ``keras_guard``): the call is inside the training
function, which only the rank runs. Every rank process calls ``install()`` before it unpickles the
training function; under the torch contract, ``HorovodBasics.init`` (the ``init`` of every Horovod
framework module: ``horovod.torch``, ``horovod.tensorflow``, ``horovod.keras``) raises
``WrongLauncherError`` at the call, before any step, naming the two fixes. Nothing is imported
because of it: a torch job that never imports Horovod never loads it.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Callable
from typing import Any

from airflow_provider_horovod.exceptions import WrongLauncherError
from airflow_provider_horovod.runner.launchers import rank_names, started_under

BASICS = "horovod.common.basics"
_MARK = "__hvdrunner_launcher_checked__"
# What says a process is a rank of Horovod's own world: the Gloo contract, or an MPI launcher's (the launchers' table).
HOROVOD_WORLD_ENV = rank_names(horovod=True)


def under_torch_contract(environ: dict[str, str] | None = None) -> bool:
    """This process was started with torchrun's contract (a launcher that runs no Horovod) and not with Horovod's."""
    env = os.environ if environ is None else environ
    return bool(started_under(env, horovod=False)) and not any(name in env for name in HOROVOD_WORLD_ENV)


def _said(what: str) -> str:
    """The rank or size this rank's contract says (the launcher that runs no Horovod), ``?`` when none."""
    found = (os.environ.get(name) for facts in started_under(os.environ, horovod=False)
             for name in facts.contract.get(what, ()))
    return next((value for value in found if value is not None), "?")


def message() -> str:
    return (
        "hvd.init() was called in a rank started with launcher=\"torch\" (rank %s of %s): that launcher gives the "
        "ranks torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR), not Horovod's, so Horovod would "
        "make every rank a world of one: nothing averaged, each rank training its own model. Either run this "
        "function with launcher=\"gloo\" or launcher=\"mpirun\" (Horovod code), or drop hvd.init() and the other "
        "hvd.* calls and use torch.distributed (dist.init_process_group(), DistributedDataParallel) under "
        "launcher=\"torch\"." % (_said("rank"), _said("size")))


def _refusing(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise WrongLauncherError(message())

    return refused


def guard_basics(module: Any) -> None:
    """Make ``HorovodBasics.init`` refuse, and rebind every framework's ``init`` taken from it already
    (a process that imported Horovod before ``install``). Idempotent."""
    cls = getattr(module, "HorovodBasics", None)
    if cls is None or getattr(cls, _MARK, False):
        return
    cls.init = _refusing(cls.init)
    setattr(cls, _MARK, True)
    for name, loaded in list(sys.modules.items()):
        bound = getattr(loaded, "init", None) if name.startswith("horovod.") else None
        if isinstance(getattr(bound, "__self__", None), cls):
            loaded.init = bound.__self__.init


class _GuardingLoader(importlib.abc.Loader):
    """The module's own loader, then ``guard_basics`` on what it executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        guard_basics(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _GuardingFinder(importlib.abc.MetaPathFinder):
    """Finds ``horovod.common.basics`` as the other finders would and gives it a guarding loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != BASICS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GuardingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Under torchrun's contract only: refuse ``hvd.init()`` in this process, from now on."""
    if not under_torch_contract():
        return
    if not any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardingFinder())
    if BASICS in sys.modules:
        guard_basics(sys.modules[BASICS])
