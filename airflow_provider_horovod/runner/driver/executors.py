"""What the executors need to run a barrier task: an interpreter with this package, cloudpickle and
what the launchers' table names for its ranks (Horovod, or torch alone). A local master gets the driver's own; elsewhere the first thing a task does is check, and
an executor without them fails the run with one line that names its host, its interpreter and the fix.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from airflow_provider_horovod.runner.launchers import facts_of

PYTHON_CONF = "spark.pyspark.python"
# What the barrier task imports, and what its ranks import (only looked for: a fraction of a millisecond).
IMPORTED = ("airflow_provider_horovod.runner.task.barrier",)
FOUND = ("cloudpickle", "horovod")
MISSING_TEXT = (
    "The executor on host %s runs %s, which cannot import %s (%s). Give the executors an "
    "interpreter with airflow-provider-horovod, %s installed, as on the driver: point "
    "PYSPARK_PYTHON or spark.pyspark.python at it, ship a virtualenv with spark.archives, or use an executor "
    "image that has them (see docs/executors.md)."
)


def python_conf(master: str | None, conf: Mapping[str, Any]) -> dict[str, str]:
    """Spark conf for a session this package creates: on a local master, the executors run the
    driver's interpreter (``sys.executable``), unless ``spark.pyspark.python`` or ``PYSPARK_PYTHON``
    already says which one."""
    if not str(master or "").startswith("local") or PYTHON_CONF in conf or os.environ.get("PYSPARK_PYTHON"):
        return {}
    return {PYTHON_CONF: sys.executable}


def give_driver_python(spark: Any) -> None:
    """For a classic session this package has just created: on a local master, its Python workers
    run the driver's interpreter, unless ``spark.pyspark.python`` or ``PYSPARK_PYTHON`` names one.
    (A session's master is known only once it exists, so it is set on its SparkContext.)"""
    with contextlib.suppress(Exception):
        sc = spark.sparkContext
        if python_conf(sc.master, {}) and not spark.conf.get(PYTHON_CONF, None):
            sc.pythonExec = sys.executable


def workers_python(spark: Any) -> str:
    """The interpreter the session's Python workers run: ``spark.pyspark.python``, else the
    SparkContext's (``PYSPARK_PYTHON``, else ``python3``); under Spark Connect the server decides,
    and this says what the driver's environment would ask for."""
    with contextlib.suppress(Exception):
        return spark.conf.get(PYTHON_CONF, None) or spark.sparkContext.pythonExec
    return os.environ.get("PYSPARK_PYTHON") or "python3"


@contextlib.contextmanager
def python_of_workers(spark: Any) -> Iterator[None]:
    """While the barrier stage's function is wrapped, give it the interpreter ``spark.pyspark.python``
    names. A Spark driver started from Python reads only ``PYSPARK_PYTHON`` for its workers (the
    conf counts only under spark-submit), though Spark documents the conf for the executors too."""
    sc = getattr(spark, "_sc", None)
    python = None
    with contextlib.suppress(Exception):
        python = spark.conf.get(PYTHON_CONF, None)
    if not python or not hasattr(sc, "pythonExec"):
        yield
        return
    before, sc.pythonExec = sc.pythonExec, python
    try:
        yield
    finally:
        sc.pythonExec = before


def needed_modules(launcher: str) -> tuple[str, ...]:
    """What the ranks import besides this package, as the launchers' table says (Horovod under mpirun
    and Gloo, torch under torch)."""
    return facts_of(launcher).rank_modules


def needs_text(found: tuple[str, ...]) -> str:
    return "%s and %s" % (", ".join(found[:-1]), found[-1])


def task_entry(spec: bytes, marker: str, run: str, found: tuple[str, ...] = FOUND) -> Callable[[Iterable[Any]], Iterable[Any]]:
    """The barrier stage's function. It is pickled by value and holds nothing of this package
    (``spec`` is the pickled ``RunSpec``), so Spark's worker unpickles it on any executor; the task
    then checks its imports before anything else and fails with ``MISSING_TEXT`` inside ``marker``
    (read by ``exits.parse_failure``) when one is missing. ``run`` names the function of
    ``runner.task.barrier`` that runs the task; ``found``: the modules its ranks import (``needed_modules``)."""
    imported, text, needs = IMPORTED, MISSING_TEXT, needs_text(found)

    def task(batches: Iterable[Any]) -> Iterable[Any]:
        import base64
        import importlib
        import importlib.util
        import json
        import platform
        import socket
        import sys

        try:
            modules = [importlib.import_module(name) for name in imported]
            absent = [name for name in found if importlib.util.find_spec(name) is None]
            if absent:
                raise ModuleNotFoundError("No module named %r" % absent[0], name=absent[0])
        except ImportError as err:
            host = socket.gethostname()
            python = "%s (Python %s)" % (sys.executable, platform.python_version())
            message = text % (host, python, err.name or "a module", err, needs)
            raw = {"message": message, "host": host, "error_class": "ExecutorMismatchError",
                   "exception": "%s: %s" % (type(err).__name__, err)}  # as exits.failure_blob writes it
            raise RuntimeError(marker + base64.b64encode(json.dumps(raw).encode()).decode() + marker) from None
        yield from getattr(modules[0], run)(spec, batches)

    return task


LOST_TASK = re.compile(r"Lost task [\d.]+ in stage [\d.]+ \(TID \d+\) \((\S+) executor [^)]*\)")
NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def missing_module_text(error: str, python: str, found: tuple[str, ...] = FOUND) -> str | None:
    """``MISSING_TEXT`` for a Spark job that failed because Spark's own worker could not import a
    module before the task's check ran (pyspark, pyarrow); ``None`` for any other failure.
    ``python``: the interpreter the driver asked the workers to run."""
    module = NO_MODULE.search(error)
    if module is None:
        return None
    host = LOST_TASK.search(error)
    return MISSING_TEXT % (host.group(1) if host else "(unknown)", python, module.group(1),
                           "No module named %r" % module.group(1), needs_text(found))
