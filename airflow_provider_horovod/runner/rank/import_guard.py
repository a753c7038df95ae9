"""An import hook for the rank's guards (``keras_guard``, ``horovod_guard``): modules of the given
names are found as the other finders would find them, and ``guard`` runs on each once it executed."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Collection
from typing import Any


class GuardingLoader(importlib.abc.Loader):
    """The module's own loader, then ``guard`` on what it executed."""

    def __init__(self, loader: Any, guard: Callable[[Any], None]) -> None:
        self._loader = loader
        self._guard = guard

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._guard(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class GuardingFinder(importlib.abc.MetaPathFinder):
    """Finds the modules ``names`` as the other finders would and gives them a guarding loader."""

    def __init__(self, names: Collection[str], guard: Callable[[Any], None]) -> None:
        self.names = frozenset(names)
        self.guard = guard

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = GuardingLoader(spec.loader, self.guard)
                return spec
        return None


def install_finder(names: Collection[str], guard: Callable[[Any], None]) -> None:
    """``guard`` the modules ``names`` imported from now on in this process (once per ``guard``)."""
    if not any(isinstance(f, GuardingFinder) and f.guard is guard for f in sys.meta_path):
        sys.meta_path.insert(0, GuardingFinder(names, guard))
