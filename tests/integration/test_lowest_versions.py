"""The lowest versions pyproject.toml allows (``constraints-lowest.txt``) pass: the unit tests, one
job per launcher on a real ``local[2]`` session and one ``airflow dags test``, run again by pytest in
a virtualenv that holds only those versions and sees the suite's virtualenv behind them (a ``.pth``
file), so nothing else is installed twice. That virtualenv is made once and kept in the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_light_install import CACHE, REPO, UV

pytestmark = [pytest.mark.slow]

LOWEST = REPO / "constraints-lowest.txt"
MADE = ".made-by-the-suite"  # written last: a venv without it was cut off while being made
# what runs under the lowest versions: every unit test, a job per launcher, a DAG run by `airflow dags test`
UNDER_LOWEST = [
    "tests/unit",
    "tests/integration/test_runner.py::test_two_ranks_return_rank_zeros_value",
    "tests/integration/test_airflow_dags.py::test_reference_string_operator_and_task_horovod_decorator",
]


def pins() -> dict[str, str]:
    lines = [line.split("==") for line in LOWEST.read_text().splitlines() if line and not line.startswith("#")]
    return {name: version for name, version in lines}


@contextlib.contextmanager
def lowest_venv() -> Iterator[Path]:
    """The lowest versions' virtualenv, made once per ``constraints-lowest.txt``, base Python and uv
    and kept in the cache, outside the repository, with its bytecode compiled (this machine sets
    ``PYTHONDONTWRITEBYTECODE``: without it every process of the run below compiles Airflow and
    PySpark again). It sees the running suite's virtualenv behind its own packages; held under a
    lock, as that ``.pth`` file is this suite's while the run lasts. Yields its ``python``."""
    uv_version = subprocess.run([UV, "--version"], check=True, capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([LOWEST.read_bytes(), sys.base_prefix.encode(), sys.version.encode(),
                                     uv_version.encode()])).hexdigest()[:12]
    where = CACHE / ("lowest-venv-%s" % key)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lowest-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = where / "bin" / "python"
        if not (where / MADE).exists():  # never made, or cut off while being made
            shutil.rmtree(where, ignore_errors=True)
            make_lowest_venv(where)
            (where / MADE).write_text(uv_version)
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        # the suite's packages behind this venv's own (addsitedir also runs their .pth files: the editable install)
        (site / "_suite_venv.pth").write_text("import site; site.addsitedir(%r)\n" % sysconfig.get_paths()["purelib"])
        yield python


def make_lowest_venv(where: Path) -> None:
    env = {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv")}
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(where)], check=True, env=env, timeout=120)
    install = [UV, "pip", "install", "-q", "--python", str(where / "bin" / "python"), "--compile-bytecode", "--no-deps",
               "-r", str(LOWEST)]
    if subprocess.run([*install, "--offline"], env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(install, check=True, env=env, timeout=900)


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
