"""Keras 3 is refused where Horovod would train it silently wrong.

Horovod 0.28's ``horovod.tensorflow.keras`` (and ``horovod.keras``) speak the Keras 2 API. Given
Keras 3 objects, its ``DistributedOptimizer`` wraps methods Keras 3 never calls, so gradients are
not averaged across ranks and every rank trains its own model without a word; its callbacks crash
on Keras 3 variables (``'Variable' object has no attribute 'ref'``). Keras 2 is ``tf.keras`` with
tf-keras installed and ``TF_USE_LEGACY_KERAS=1`` (the runner sets it for every rank unless the user
did, see ``task.barrier.base_env``); ``import keras`` is Keras 3 whatever that variable says.

Why an import hook in the rank process: the Keras objects only exist inside the training
function, so the driver cannot see them before the job starts. Every rank process calls
``install()`` before it unpickles the training function; when (and only when) that function
imports Horovod's Keras modules, their entry points are wrapped with a check, so a Keras 3
optimizer, model or callback target raises ``Keras3NotSupportedError`` at the call, before the
first training step. A torch job never imports TensorFlow because of it.

Checked: ``DistributedOptimizer`` / ``PartialDistributedOptimizer`` (the optimizer),
``load_model`` (the model it returns), and ``set_model`` of every callback class of the
``callbacks`` and ``elastic`` modules (the model ``fit`` hands them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Any

from airflow_provider_horovod.exceptions import Keras3NotSupportedError

LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"

_KERAS_MODULES = ("horovod.tensorflow.keras", "horovod.keras")
_CALLBACK_MODULES = tuple("%s.%s" % (m, sub) for m in _KERAS_MODULES for sub in ("callbacks", "elastic"))
_OPTIMIZER_FUNCTIONS = ("DistributedOptimizer", "PartialDistributedOptimizer")
_MARK = "__hvdrunner_keras_checked__"


def keras3_class(obj: object) -> str | None:
    """The name of ``obj``'s Keras 3 class, or ``None`` when it is not a Keras 3 object."""
    keras = sys.modules.get("keras")  # nothing can be a Keras 3 object before Keras 3 is imported
    if keras is None:
        return None
    version = getattr(keras, "__version__", None)
    if not isinstance(version, str):
        with contextlib.suppress(Exception):
            version = importlib.metadata.version("keras")
    major = str(version).split(".")[0]
    if not major.isdigit() or int(major) < 3:
        return None
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", None) or ""
        if module.split(".")[0] == "keras":
            return "%s.%s (Keras %s)" % (module, cls.__qualname__, version)
    return None


def refuse(obj: object, where: str) -> None:
    """Raise ``Keras3NotSupportedError`` when ``obj`` is a Keras 3 object handed to ``where``."""
    found = keras3_class(obj)
    if found is None:
        return
    legacy = os.environ.get(LEGACY_KERAS_ENV)
    why_tf_keras = (  # the values TensorFlow itself accepts
        "" if legacy in ("1", "true", "True")
        else " Here tf.keras is Keras 3 too, because %s is %s in this rank's environment: set it to 1, or "
             "leave it unset and the runner sets it." % (LEGACY_KERAS_ENV, "unset" if legacy is None else repr(legacy))
    )
    raise Keras3NotSupportedError(
        "%s was given a Keras 3 object, %s. Horovod's Keras support speaks the Keras 2 API only: with "
        "Keras 3 it does not average gradients across ranks (each rank silently trains its own model) "
        "and its callbacks crash, so the runner refuses it. Build the model and the optimizer with "
        "tf.keras (`import tensorflow as tf; tf.keras.Sequential(...)`, `tf.keras.optimizers.SGD(...)`: "
        "Keras 2 from the tf-keras package, which `pip install airflow-provider-horovod[tensorflow]` "
        "installs and %s=1 selects), not with `import keras`; or train with horovod.tensorflow: "
        "tf.GradientTape + hvd.DistributedGradientTape + hvd.broadcast_variables.%s"
        % (where, found, LEGACY_KERAS_ENV, why_tf_keras)
    )


def _checking_argument(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        refuse(optimizer, where)
        return fn(optimizer, *args, **kwargs)

    return checked


def _checking_result(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        refuse(result, where)
        return result

    return checked


def _checking_set_model(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def set_model(self: Any, model: Any) -> Any:
        refuse(model, where)
        return fn(self, model)

    return set_model


def guard_module(module: Any) -> None:
    """Wrap the entry points of one of Horovod's Keras modules (idempotent)."""
    name = module.__name__
    if getattr(module, _MARK, False):
        return
    if name in _KERAS_MODULES:
        for attr in _OPTIMIZER_FUNCTIONS:
            if callable(getattr(module, attr, None)):
                setattr(module, attr, _checking_argument(getattr(module, attr), "%s.%s" % (name, attr)))
        if callable(getattr(module, "load_model", None)):
            module.load_model = _checking_result(module.load_model, "%s.load_model" % name)
    elif name in _CALLBACK_MODULES:
        for attr, cls in list(vars(module).items()):
            if isinstance(cls, type) and cls.__module__ == name and callable(getattr(cls, "set_model", None)):
                cls.set_model = _checking_set_model(cls.set_model, "%s.%s" % (name, attr))
    setattr(module, _MARK, True)


class _GuardingLoader(importlib.abc.Loader):
    """The module's own loader, then ``guard_module`` on what it executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        guard_module(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _GuardingFinder(importlib.abc.MetaPathFinder):
    """Finds Horovod's Keras modules as the other finders would and gives them a guarding loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _KERAS_MODULES and fullname not in _CALLBACK_MODULES:
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
    """Guard Horovod's Keras modules in this process: those imported already, and those to come."""
    if not any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardingFinder())
    for name in (*_KERAS_MODULES, *_CALLBACK_MODULES):
        if name in sys.modules:
            guard_module(sys.modules[name])
