"""The training stack a host holds, read without importing Horovod, and the driver's check of it."""

from __future__ import annotations

import subprocess
import sys

from airflow_provider_horovod.runner import environment

# A fresh interpreter whose Horovod is hidden or replaced (PYTHONPATH), running a job as a user would.
RUN_A_JOB = """
import sys
for name in sys.argv[2:]:
    sys.modules[name] = None  # not installed: import fails, importlib.util.find_spec says None
from airflow_provider_horovod import HorovodRunner, TrainingStackError
try:
    HorovodRunner(2, launcher=sys.argv[1]).run(print)
except TrainingStackError as err:
    print(err)
print("spark started" if "pyspark.sql.session" in sys.modules else "no spark")
"""


def run_a_job(launcher: str, *hidden: str, pythonpath: str = "") -> str:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", RUN_A_JOB, launcher, *hidden], capture_output=True, text=True,
                          env=env, timeout=120).stdout


def test_the_installed_horovod_build_names_its_frameworks_mpi_and_gloo_without_importing_it():
    build = environment.horovod_build()
    assert build is not None and build.version == "0.28.1"
    assert any(f.startswith("pytorch 2.") for f in build.frameworks)
    assert build.controllers == ("MPI", "Gloo")
    assert environment.stack_of_this_host() == {"provider": environment.provider_version(), "horovod": build.describe()}


def test_a_job_without_horovod_fails_before_spark_starts_naming_the_install_command():
    out = run_a_job("gloo", "horovod")
    assert "Horovod is not installed in %s" % sys.executable in out
    assert "pip install 'airflow-provider-horovod[torch]' then airflow-horovod build" in out
    assert out.strip().endswith("no spark")


def test_a_horovod_built_as_pypis_sdist_builds_it_is_refused_before_spark_starts(tmp_path):
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (tmp_path / "horovod" / "metadata.json").write_text('{"dummy": "none"}')
    out = run_a_job("mpirun", pythonpath=str(tmp_path))
    assert "built without any framework, MPI or Gloo" in out and "airflow-horovod build" in out
    assert out.strip().endswith("no spark")


def test_a_horovod_built_for_torch_without_torch_installed_names_torch():
    out = run_a_job("gloo", "torch", "tensorflow")
    assert "but neither torch nor tensorflow is installed" in out and "[torch]" in out
    assert out.strip().endswith("no spark")
