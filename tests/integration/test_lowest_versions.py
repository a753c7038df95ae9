"""The lowest versions pyproject.toml allows (``constraints-lowest.txt``) pass: the unit tests of
what uses Airflow or PySpark, one job per launcher on a real ``local[2]`` session and one
``airflow dags test``, run again by pytest in a virtualenv that holds only those versions and sees
the suite's virtualenv behind them (a ``.pth`` file), so nothing else is installed twice. That
virtualenv is made once and kept in the cache.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import venvs

pytestmark = [pytest.mark.slow]

REPO = venvs.REPO
LOWEST = REPO / "constraints-lowest.txt"
# What runs under the lowest versions: the unit tests whose code paths use the libraries pinned lower
# there (Airflow, its task SDK and Spark provider, PySpark; everything else is the suite's own, so a
# test that touches none of them would run the same code twice), a job per launcher, a DAG run by
# `airflow dags test`. Left to the suite alone: the engine's unit tests (runner/ but its executors
# check; the engine never imports Airflow, and imports PySpark only where a session is used), the
# runtime, metrics, builder, setup script, exceptions and the view's store (plain files).
UNDER_LOWEST = [
    "tests/unit/hooks/test_horovod.py",  # Airflow connections -> a real local[2] SparkSession; the store
    "tests/unit/hooks/test_mlflow.py",  # an Airflow connection's fields
    "tests/unit/operators/test_horovod.py",  # BaseOperator, @task.horovod, templating
    "tests/unit/operators/test_resume_and_store_steps.py",  # the operator's steps with Airflow's Context
    "tests/unit/plugins/test_view_page.py",  # the view's page as an Airflow plugin serves it
    "tests/unit/test_links.py",  # extra links and the plugin's tab
    "tests/unit/test_retry.py",  # RetryPolicy, RetryDecision, the serialization Airflow requires
    "tests/unit/test_store.py",  # ObjectStoragePath (file:// and s3:// through Airflow's aws connection)
    "tests/unit/test_example_dags.py",  # Airflow's DagBag parses the example DAGs
    "tests/unit/test_doc_snippets.py",  # Airflow's BundleDagBag parses the documentation's DAGs
    "tests/unit/runner/driver/test_executors.py",  # pyspark.cloudpickle and the PySpark worker errors the check reads
    "tests/integration/test_runner.py::test_two_ranks_return_rank_zeros_value",
    "tests/integration/test_airflow_dags.py::test_reference_string_operator_and_task_horovod_decorator",
]


def pins() -> dict[str, str]:
    lines = [line.split("==") for line in LOWEST.read_text().splitlines() if line and not line.startswith("#")]
    return {name: version for name, version in lines}


@contextlib.contextmanager
def lowest_venv() -> Iterator[Path]:
    """The lowest versions' virtualenv, made once per ``constraints-lowest.txt`` and kept in the cache
    (``venvs.cached_venv``), seeing the running suite's virtualenv behind its own packages (a ``.pth``
    file, this run's while it holds the lock). Yields its ``python``."""
    with venvs.cached_venv("lowest-venv", [LOWEST.read_bytes()], make_lowest_venv) as python:
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        # the suite's packages behind this venv's own (addsitedir also runs their .pth files: the editable install)
        (site / "_suite_venv.pth").write_text("import site; site.addsitedir(%r)\n" % sysconfig.get_paths()["purelib"])
        yield python


def make_lowest_venv(python: Path) -> None:
    venvs.uv_install(python, "--compile-bytecode", "--no-deps", "-r", str(LOWEST))


def test_the_lowest_supported_versions_pass_the_unit_tests_a_job_per_launcher_and_a_dag_run():
    started = time.monotonic()
    with lowest_venv() as python:
        run_under_lowest(python, started)


def run_under_lowest(python: Path, started: float) -> None:
    seen = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                           "print(*(m.version(n) for n in sys.argv[1:]))", *pins()],
                          check=True, capture_output=True, text=True).stdout.split()
    assert dict(zip(pins(), seen)) == pins()
    assert importlib.metadata.version("pyspark") != pins()["pyspark"]  # the suite's own is another
    made = time.monotonic() - started
    env = {**os.environ, "PATH": "%s:%s" % (python.parent, os.environ["PATH"]), "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rs", *UNDER_LOWEST],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print("lowest venv ready in %.1f s, its tests took %.1f s: %s" % (made, time.monotonic() - started - made,
                                                                    proc.stdout.strip().splitlines()[-1]))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1]
