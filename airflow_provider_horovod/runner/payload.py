"""The payload: the training callable and its arguments, cloudpickled once on the driver.

A callable whose module the executors cannot import (``__main__``, a notebook, an Airflow DAG
file imported under a mangled name, a test module) is pickled by value; one that lives in an
installed package is pickled by reference, as any library function is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import importlib
import importlib.util
import inspect
import io
import linecache
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
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


def _local(module: types.ModuleType | None, folder: Path) -> bool:
    """A module of the user's own beside the function's file (a helper next to the DAG file): not
    installed, and importable only because ``folder`` is on the driver's ``sys.path`` (as Airflow
    puts the DAG folder, or Python a script's own); the executors cannot import it by name."""
    path = getattr(module, "__file__", None)
    if module is None or not path or module.__name__.startswith("airflow_provider_horovod") or _installed(module):
        return False
    return _beside(module.__name__, path, folder)


def _beside(name: str, path: str, folder: Path) -> bool:
    top = name.split(".", 1)[0]
    found = Path(path).resolve()
    return found.is_relative_to(folder) and (found == folder / (top + ".py") or found.is_relative_to(folder / top))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _uses(obj: Any) -> tuple[set[str], list[Any]]:
    """What a function's code imports (module names) and the globals it reads, nested functions included."""
    fn = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(fn, "__code__", None)
    if code is None:
        return set(), []
    imports, names = set(), set()
    for inner in _codes(code):
        for ins in dis.get_instructions(inner):
            if ins.opname == "IMPORT_NAME":
                imports.add(str(ins.argval))
            elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names.add(str(ins.argval))
    fn_globals = getattr(fn, "__globals__", {})
    values = [fn_globals[n] for n in sorted(names) if n in fn_globals]
    values += [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _has_contents(c)]
    return imports, values


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _members(module: types.ModuleType) -> list[Any]:
    """The functions and classes a module defines itself (what its users may call on the executors)."""
    return [v for v in vars(module).values()
            if (inspect.isfunction(v) or inspect.isclass(v)) and getattr(v, "__module__", None) == module.__name__]


@dataclasses.dataclass
class Uses:
    """What a training function reaches: the modules its code (and its own helpers') imports when it
    runs, the modules it reads as globals, and the user's modules beside its file among them."""

    imports: set[str]
    globals: set[str]
    local: list[types.ModuleType]

    def names(self) -> set[str]:
        return self.imports | self.globals


def used_modules(fn: Callable[..., Any]) -> Uses:
    """What ``fn`` uses (``Uses``), following the functions and classes of its own module and of
    the user's modules beside its file (helpers next to a DAG file, which executors cannot import)."""
    try:
        folder = Path(inspect.getsourcefile(fn) or "").resolve().parent
    except TypeError:
        folder = None
    imports: set[str] = set()
    referenced: set[str] = set()
    local: dict[str, types.ModuleType] = {}
    seen: set[int] = set()
    todo: list[Any] = [fn]
    home = sys.modules.get(getattr(fn, "__module__", None) or "")
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            referenced.add(obj.__name__)
            if folder is not None and _local(obj, folder):
                local.setdefault(obj.__name__, obj)
                todo += _members(obj)
            continue
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        if module is not None and module is not home and folder is not None and _local(module, folder):
            local.setdefault(module.__name__, module)
            todo += _members(module)
        if module is not None and (module is home or module.__name__ in local) or obj is fn:
            if inspect.isclass(obj):
                todo += [v for v in vars(obj).values() if inspect.isfunction(v)]
            else:
                names, values = _uses(obj)
                imports |= names
                todo += values
    return Uses(imports=imports, globals=referenced, local=list(local.values()))


def _ship_local_modules(fn: Callable[..., Any], uses: Uses) -> None:
    """Helpers beside the function's file go by value; one imported *inside* a function cannot (the
    import runs on the executor, where that folder is not on ``sys.path``): refused, with the fix."""
    for module in uses.local:
        if not str(getattr(module, "__file__", "")).endswith(".py"):
            raise PayloadError("The training function uses %s (%s), which is not a Python source file the payload can "
                               "carry. Install it on every executor." % (module.__name__, module.__file__))
        cloudpickle.register_pickle_by_value(module)
    imports = uses.imports
    if not imports:
        return
    try:
        folder = Path(inspect.getsourcefile(fn) or "").resolve().parent
    except TypeError:
        return
    for name in sorted(imports):
        module = sys.modules.get(name)
        top = name.split(".", 1)[0]
        if module is None and top not in sys.builtin_module_names:
            # the top-level name only: a submodule's spec imports its parents (horovod.tensorflow imports
            # TensorFlow, seconds and a GB on the driver); whether it lies beside the file is the top's say
            origin = getattr(_find_spec(top), "origin", None)
            if origin and not str(Path(origin).resolve()).startswith(_INSTALLED_ROOTS) and _beside(name, origin, folder):
                raise _inside_import(fn, name, origin)
        elif module is not None and _local(module, folder):
            raise _inside_import(fn, name, module.__file__)


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _inside_import(fn: Callable[..., Any], name: str, origin: str | None) -> PayloadError:
    return PayloadError(
        "The training function %s imports %r (%s) inside a function: that import runs on the executors, where the "
        "folder beside your file is not on sys.path. Import it at the top of %s instead (the payload then carries "
        "it by value), or install it on every executor." % (getattr(fn, "__qualname__", repr(fn)), name, origin,
                                                            Path(inspect.getsourcefile(fn) or "?").name))


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


def _sources(fn: Callable[..., Any], helpers: list[types.ModuleType] = ()) -> dict[str, str]:
    """The source files of a function pickled by value and of the helpers beside it that travel with
    it, for the ranks' tracebacks on hosts without them."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    files = [getattr(m, "__file__", None) for m in helpers]
    if module is not None and not _installed(module) and not module.__name__.startswith("airflow_provider_horovod"):
        with contextlib.suppress(TypeError):
            files.insert(0, inspect.getsourcefile(fn))
    found = {}
    for path in filter(None, files):
        with contextlib.suppress(OSError):
            if Path(path).stat().st_size <= MAX_SOURCE_BYTES:
                found[path] = Path(path).read_text(errors="replace")
    return found


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
    uses = used_modules(fn)
    _ship_local_modules(fn, uses)
    try:
        return _dumps((fn, tuple(args), kwargs, _sources(fn, uses.local)))
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
