"""The package as a user installs it: the sdist and wheel ``python -m build`` makes, the wheel in a
new virtualenv, the Horovod builder run from there, an example DAG under ``airflow dags test`` and
the Horovod view's page, all from the installed wheel, never from this checkout.

The new virtualenv gets the built wheel with ``pip install --no-deps`` and sees the suite's
dependencies (Airflow, PySpark, torch, ...) through a ``.pth`` file naming the suite venv's
site-packages: a ``.pth`` line only appends a folder to ``sys.path``, so the suite's editable
install of this package (its own ``.pth`` and finder) does not come along. Every process runs
outside the checkout, without ``PYTHONPATH``. A module or file missing from the wheel (the plugin,
the view) fails here, as it would for a user.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from airflow_provider_horovod import builder
from tests.integration.deployment import task_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

REPO = Path(__file__).resolve().parents[2]
DAG = "horovod_digits_train"
DAG_TIMEOUT_S = 300
# Run by the wheel's Python: where the package comes from, and the Horovod view's page for DAG's
# last run, served by Airflow's own API app (the plugin found through the wheel's entry point).
VIEW_PROBE = """
import json, sys
from urllib.parse import quote
import airflow_provider_horovod
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app
task = "/horovod/dags/%s/runs/%s/tasks/train" % (sys.argv[1], quote(sys.argv[2], safe=""))
client = TestClient(create_app())
page, timeline = client.get(task), client.get(task + "/tries/1/timeline.svg")
print(json.dumps({"package": airflow_provider_horovod.__file__, "status": page.status_code, "page": page.text,
                  "timeline": [timeline.status_code, timeline.text[:200]],
                  "editable": sorted(m for m in sys.modules if "__editable__" in m)}))
"""


class WheelVenv:
    """A new virtualenv holding the built wheel, over the suite venv's dependencies."""

    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.home = root / "airflow"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        self.python = root / "venv" / "bin" / "python"
        self.env = self._env()
        site = Path(self.run_python("import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
        (site / "suite-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
        self.run_python("import runpy; runpy.run_module('pip', run_name='__main__')",
                        "install", "--no-deps", "-q", str(wheel))

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW_CONN_")}
        env.update(task_env(self.root / "artifacts"))
        bin_dir = str(self.python.parent)
        env.update({"AIRFLOW_HOME": str(self.home), "AIRFLOW__CORE__DAGS_FOLDER": str(self.root / "dags"),
                    "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                    "PYSPARK_PYTHON": str(self.python), "PYSPARK_DRIVER_PYTHON": str(self.python),
                    "PATH": "%s:%s" % (bin_dir, env["PATH"])})
        return env

    def run_python(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run([str(self.python), "-c", code, *args], timeout=timeout)

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-5000:])
        return proc

    def airflow(self, *args: str, timeout: float = DAG_TIMEOUT_S) -> subprocess.CompletedProcess:
        return self.run([str(self.python), "-m", "airflow", *args], timeout=timeout)


def frameworks_here() -> tuple[str, ...]:
    """The frameworks of the suite venv, so the builder asks for the wheel ``scripts/setup`` cached."""
    return ("torch", builder.TENSORFLOW) if importlib.util.find_spec("tensorflow") else ("torch",)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel_venv(dist, tmp_path_factory) -> WheelVenv:
    return WheelVenv(tmp_path_factory.mktemp("wheel-user"), next(dist.glob("*.whl")))


def test_built_sdist_and_wheel_pass_twine_and_ship_the_plugin_view_and_builder(dist):
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr
    wheel = zipfile.ZipFile(next(dist.glob("*.whl")))
    names = set(wheel.namelist())
    assert {"airflow_provider_horovod/plugins/view.py", "airflow_provider_horovod/builder.py"} <= names
    entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "airflow-horovod = airflow_provider_horovod.builder:main" in entry_points
    assert "horovod = airflow_provider_horovod.plugins.horovod:entry_point" in entry_points


def test_builder_from_the_wheel_installs_and_verifies_the_cached_horovod(wheel_venv):
    wanted = frameworks_here()
    key = builder.cache_key(wanted, {f: builder.installed_version(f) for f in wanted})
    cached = builder.cached_wheel(builder.cache_root() / "wheels" / key)
    assert cached is not None, "no cached Horovod wheel %s: run scripts/setup --with tensorflow first" % key
    argv = [str(wheel_venv.python.parent / "airflow-horovod"), "build"]
    built = wheel_venv.run(argv + (["--with", builder.TENSORFLOW] if builder.TENSORFLOW in wanted else []), timeout=300)
    assert "Building" not in built.stdout  # a cache hit: install and verify only
    assert "Horovod 0.28.1 installed from %s" % cached in built.stdout
    horovod = wheel_venv.run_python("import horovod; print(horovod.__file__)").stdout.strip()
    assert Path(horovod).is_relative_to(wheel_venv.root / "venv"), horovod
    suite_horovod = Path(sysconfig.get_path("purelib")) / "horovod" / "__init__.py"
    assert suite_horovod.exists()  # pip installed beside the suite's Horovod; it did not uninstall it


def test_example_dag_and_the_horovod_view_run_from_the_installed_wheel(wheel_venv):
    (wheel_venv.root / "dags").mkdir()
    (wheel_venv.root / "dags" / ("%s.py" % DAG)).write_text((REPO / "dags" / ("%s.py" % DAG)).read_text())
    wheel_venv.airflow("db", "migrate")
    wheel_venv.airflow("dags", "test", DAG)
    with sqlite3.connect(wheel_venv.home / "airflow.db") as db:
        (run_id,), = db.execute("SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (DAG,))
    probe = json.loads(wheel_venv.run_python(VIEW_PROBE, DAG, run_id).stdout.strip().splitlines()[-1])
    assert Path(probe["package"]).is_relative_to(wheel_venv.root / "venv"), probe["package"]
    assert probe["editable"] == []
    assert probe["status"] == 200, probe["page"][:2000]
    assert "Horovod · %s / train" % DAG in probe["page"] and "checkpoints/model.pt" in probe["page"]
    assert probe["timeline"][0] == 200 and "<svg" in probe["timeline"][1], probe["timeline"]
