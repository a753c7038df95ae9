"""The payload: the training callable and its arguments, cloudpickled once on the driver.

A callable whose module the executors cannot import (``__main__``, a notebook, an Airflow DAG
file imported under a mangled name, a test module) is pickled by value; one that lives in an
installed package is pickled by reference, as any library function is.
"""

from __future__ import annotations

import importlib
import inspect
import io
import linecache
import sys
import sysconfig
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from airflow_provider_horovod.exceptions import PayloadError

_INSTALLED_ROOTS = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]}
)


def resolve_callable(main: Callable[..., Any] | str) -> Callable[..., Any]:
    """Return ``main`` itself, or the function a ``"package.module:function"`` string names."""
    if callable(main):
        return main
    if not isinstance(main, str) or main.count(":") != 1:
        raise PayloadError(
            "The training callable must be a function or a 'package.module:function' string; got %r." % (main,)
        )
    module_name, _, attr = main.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise PayloadError(
            "Cannot import module %r named in %r (%s: %s). Install the package on the driver and the "
            "executors, or pass the function itself." % (module_name, main, type(err).__name__, err)
        ) from err
    try:
        target = getattr(module, attr)
    except AttributeError:
        raise PayloadError("Module %r has no attribute %r (from %r)." % (module_name, attr, main)) from None
    if not callable(target):
        raise PayloadError("%r is a %s, not a callable." % (main, type(target).__name__))
    return target


def _installed(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if not path:
        return False
    resolved = str(Path(path).resolve())
    return resolved.startswith(_INSTALLED_ROOTS)


def _register_by_value(fn: Callable[..., Any]) -> None:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ == "__main__" or module.__name__.startswith("airflow_provider_horovod"):
        return  # __main__ is pickled by value already; our own package is installed everywhere
    if not _installed(module):
        cloudpickle.register_pickle_by_value(module)


def _culprit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Name the first object that does not pickle, for the error message."""
    candidates: list[tuple[str, Any]] = [("argument %d" % i, a) for i, a in enumerate(args)]
    candidates += [("keyword argument %r" % k, v) for k, v in kwargs.items()]
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                candidates.append(("closure variable %r" % name, cell.cell_contents))
            except ValueError:
                pass
        fn_globals = getattr(fn, "__globals__", {})
        candidates += [("global %r" % n, fn_globals[n]) for n in code.co_names if n in fn_globals]
    for label, value in candidates:
        if isinstance(value, types.ModuleType):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as err:
            return "%s (a %s: %s)" % (label, type(value).__name__, err)
    return "the function itself"


def check_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Fail as the call in the ranks would, but now: ``PayloadError`` when the arguments do not fit
    ``fn``'s signature (only their number and names count, not their values)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the ranks' call will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise PayloadError(
            "The arguments do not fit the training function %s%s: %s. Fix op_args/op_kwargs (or the "
            "arguments given to run())." % (getattr(fn, "__qualname__", repr(fn)), _as_written(signature), err)
        ) from None


def _as_written(signature: inspect.Signature) -> str:
    """``signature`` as its source reads, also under ``from __future__ import annotations`` (whose
    annotations are strings, which ``str(signature)`` would quote)."""
    def plain(annotation: Any) -> Any:
        return _Written(annotation) if isinstance(annotation, str) else annotation

    return str(signature.replace(
        parameters=[p.replace(annotation=plain(p.annotation)) for p in signature.parameters.values()],
        return_annotation=plain(signature.return_annotation)))


class _Written(str):
    """An annotation given as a string, shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, keeping the file name of code pickled by value: cloudpickle writes
    ``<dynamic-code>`` instead (for payloads that do not depend on where a function was defined),
    so a rank's traceback would never name the user's own file."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and _code_reduce is not None:
            code_type, fields = _code_reduce(obj)
            return code_type, tuple(obj.co_filename if f == _DYNAMIC else f for f in fields)
        return super().reducer_override(obj)


_code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)  # absent: tracebacks say <dynamic-code>
_DYNAMIC = "<dynamic-code>"
MAX_SOURCE_BYTES = 1 << 20


def _sources(fn: Callable[..., Any]) -> dict[str, str]:
    """The source file of a function pickled by value, for the ranks' tracebacks on hosts without it."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or _installed(module) or module.__name__.startswith("airflow_provider_horovod"):
        return {}
    try:
        path = inspect.getsourcefile(fn)
        if path is None or Path(path).stat().st_size > MAX_SOURCE_BYTES:
            return {}
        return {path: Path(path).read_text(errors="replace")}
    except (OSError, TypeError):
        return {}


def _dumps(value: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return out.getvalue()


def build_payload(main: Callable[..., Any] | str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> bytes:
    """Pickle ``main`` with its arguments (and its source file, when it is pickled by value); raise
    ``PayloadError`` naming what cannot be pickled, or when the arguments do not fit its signature."""
    fn = resolve_callable(main)
    kwargs = dict(kwargs or {})
    check_arguments(fn, tuple(args), kwargs)
    _register_by_value(fn)
    try:
        return _dumps((fn, tuple(args), kwargs, _sources(fn)))
    except Exception as err:
        name = getattr(fn, "__qualname__", repr(fn))
        raise PayloadError(
            "Cannot pickle the training job %s: %s cannot be pickled. Create such objects inside the "
            "training function (imports, clients, locks, open files) instead of capturing them."
            % (name, _culprit(fn, tuple(args), kwargs))
        ) from err


def load_payload(data: bytes) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The function and its arguments; the source files that came with them are where this
    process's tracebacks read their lines (``linecache``), whether or not this host has them."""
    fn, args, kwargs, sources = cloudpickle.loads(data)
    for path, text in sources.items():
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)  # mtime None: never re-read
    return fn, args, kwargs


def describe(main: Callable[..., Any] | str) -> str:
    fn = resolve_callable(main)
    module = getattr(fn, "__module__", "?")
    return "%s.%s" % (module, getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn))))
