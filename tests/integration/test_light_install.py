"""The light base package, as the scheduler, DAG processor and API server get it: a virtualenv of its
own with only the base dependencies (no torch, no Horovod, no TensorFlow) imports every module of the
package, parses the example DAGs, serves the Horovod view's page, and a job there fails before Spark
starts with the command that installs the training stack.

The virtualenv is made once with uv and kept in the cache outside the repository
(``venvs.cached_venv``, keyed by ``pyproject.toml`` and ``constraints.txt``; a first run downloads the
~140 base packages once); each run installs this checkout into it again, editable and alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration import venvs

pytestmark = [pytest.mark.slow]

REPO = venvs.REPO
INSTALL_HINT = "pip install 'airflow-provider-horovod[torch]' then airflow-horovod build"

CHECK = """
import importlib, importlib.util, json, sys
for name in ("airflow_provider_horovod.operators.horovod", "airflow_provider_horovod.decorators.horovod",
             "airflow_provider_horovod.hooks.horovod", "airflow_provider_horovod.links",
             "airflow_provider_horovod.plugins.horovod", "airflow_provider_horovod.plugins.view",
             "airflow_provider_horovod.runner.driver.runner", "airflow_provider_horovod.runner.task.barrier"):
    importlib.import_module(name)
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app
page = TestClient(create_app()).get("/horovod/dags/horovod_digits_train/runs/r1/tasks/train")
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
try:  # an s3:// root without the [s3] extra
    HorovodRunnerHook.check_artifact_root("s3://aws_default@bucket/horovod")
    s3 = "accepted"
except Exception as err:
    s3 = "%s: %s" % (type(err).__name__, err)
print(json.dumps({"absent": [m for m in ("torch", "horovod", "tensorflow") if importlib.util.find_spec(m) is None],
                  "dags": sorted(bag.dag_ids), "errors": {k: str(v) for k, v in bag.import_errors.items()},
                  "page": [page.status_code, page.text], "s3": s3}))
"""


def make_light_venv(python: Path) -> None:
    """Only the base dependencies, pinned by constraints.txt (the checkout comes and goes: ``light_venv``)."""
    venvs.uv_install(python, "--compile-bytecode", "-c", str(REPO / "constraints.txt"), "-e", str(REPO))


@pytest.fixture(scope="module")
def light_venv():
    started = time.monotonic()
    keyed_by = [(REPO / "pyproject.toml").read_bytes(), (REPO / "constraints.txt").read_bytes()]
    with venvs.cached_venv("light-venv", keyed_by, make_light_venv) as python:
        # this checkout, not the one that made the venv (the package alone, editable: its entry points too)
        venvs.uv_install(python, "--no-deps", "--reinstall-package", "airflow-provider-horovod", "-e", str(REPO))
        print("light virtualenv ready in %.1f s" % (time.monotonic() - started))
        yield python.parent


def airflow_env(bin_dir: Path, home: Path, dags: Path) -> dict[str, str]:
    return {"PATH": "%s:/usr/bin:/bin" % bin_dir, "HOME": os.environ.get("HOME", "/root"), "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True", "SPARK_LOCAL_IP": "127.0.0.1"}


def test_the_light_install_parses_dags_serves_the_view_and_a_job_fails_before_spark_naming_the_install(
        light_venv, tmp_path):
    env = airflow_env(light_venv, tmp_path, REPO / "tests" / "integration" / "airflow_dags")
    subprocess.run([str(light_venv / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.run([str(light_venv / "python"), "-c", CHECK, str(REPO / "dags")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["absent"] == ["torch", "horovod", "tensorflow"]
    assert seen["errors"] == {}
    assert seen["dags"] == ["horovod_digits_retrain", "horovod_digits_train", "horovod_keras_digits"]
    status, text = seen["page"]
    assert status == 200 and "<title>Horovod · horovod_digits_train / train</title>" in text
    assert seen["s3"].startswith("ArtifactSettingsError: The artifact root s3://aws_default@bucket/horovod needs a file system "
                                 "for s3://, which is not installed"), seen["s3"]
    assert 'pip install "airflow-provider-horovod[s3]"' in seen["s3"]

    run = subprocess.run([str(light_venv / "airflow"), "dags", "test", "hvd_test_tasks"], env=env, capture_output=True,
                         text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode != 0
    assert "TrainingStackError: Horovod is not installed in %s" % (light_venv / "python") in log
    assert INSTALL_HINT in log
    assert "Starting a SparkSession" not in log and "SparkContext" not in log
