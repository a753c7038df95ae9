"""The lowest versions pyproject.toml allows (``constraints-lowest.txt``) pass: the unit tests, one
job per launcher on a real ``local[2]`` session and one ``airflow dags test``, run again by pytest in
a virtualenv that holds only those versions and sees the suite's virtualenv behind them (a ``.pth``
file), so nothing else is installed twice.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.integration.test_light_install import CACHE, REPO, UV

pytestmark = [pytest.mark.slow]

LOWEST = REPO / "constraints-lowest.txt"
# what runs under the lowest versions: every unit test, a job per launcher, a DAG run by `airflow dags test`
UNDER_LOWEST = [
    "tests/unit",
    "tests/integration/test_runner.py::test_two_ranks_return_rank_zeros_value",
    "tests/integration/test_airflow_dags.py::test_reference_string_operator_and_task_horovod_decorator",
]


def pins() -> dict[str, str]:
    lines = [line.split("==") for line in LOWEST.read_text().splitlines() if line and not line.startswith("#")]
    return {name: version for name, version in lines}


def make_lowest_venv(where: Path) -> Path:
    env = {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv")}
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(where)], check=True, env=env, timeout=120)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the suite's packages behind this venv's own (addsitedir also runs their .pth files: the editable install)
    (site / "_suite_venv.pth").write_text("import site; site.addsitedir(%r)\n" % sysconfig.get_paths()["purelib"])
    install = [UV, "pip", "install", "-q", "--python", str(python), "--no-deps", "-r", str(LOWEST)]
    if subprocess.run([*install, "--offline"], env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(install, check=True, env=env, timeout=900)
    return python


def test_the_lowest_supported_versions_pass_the_unit_tests_a_job_per_launcher_and_a_dag_run(tmp_path):
    started = time.monotonic()
    python = make_lowest_venv(tmp_path / "venv")
    seen = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                           "print(*(m.version(n) for n in sys.argv[1:]))", *pins()],
                          check=True, capture_output=True, text=True).stdout.split()
    assert dict(zip(pins(), seen)) == pins()
    assert importlib.metadata.version("pyspark") != pins()["pyspark"]  # the suite's own is another
    made = time.monotonic() - started
    env = {**os.environ, "PATH": "%s:%s" % (python.parent, os.environ["PATH"]), "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rs", *UNDER_LOWEST],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print("lowest venv made in %.1f s, its tests took %.1f s: %s" % (made, time.monotonic() - started - made,
                                                                    proc.stdout.strip().splitlines()[-1]))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1]
