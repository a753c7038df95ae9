"""What the executors need: the driver's interpreter on a local master, one line when they lack the package."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from pyspark import cloudpickle as spark_cloudpickle

from airflow_provider_horovod.runner.driver import executors
from airflow_provider_horovod.runner.exits import ERROR_MARKER, parse_failure

# A fresh interpreter in which this package cannot be imported, as on an executor without it; it
# unpickles the barrier stage's function as Spark's worker does and runs it.
WITHOUT_PACKAGE = """
import sys, importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == sys.argv[1]:
            raise ModuleNotFoundError("No module named %r" % name, name=name)
sys.meta_path.insert(0, Absent())
from pyspark import cloudpickle
task = cloudpickle.loads(sys.stdin.buffer.read())
try:
    list(task(iter([])))
except RuntimeError as err:
    print(err)
"""


@pytest.fixture()
def no_pyspark_python(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)


def test_local_master_executors_get_the_driver_interpreter(no_pyspark_python):
    assert executors.python_conf("local[2]", {}) == {"spark.pyspark.python": sys.executable}


def test_executor_interpreter_the_user_chose_is_kept(no_pyspark_python, monkeypatch):
    assert executors.python_conf("local[2]", {"spark.pyspark.python": "/opt/py/bin/python"}) == {}
    assert executors.python_conf("yarn", {}) == {}
    assert executors.python_conf("spark://master:7077", {}) == {}
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/py/bin/python")
    assert executors.python_conf("local[2]", {}) == {}


@pytest.mark.parametrize("absent", ["airflow_provider_horovod", "cloudpickle", "horovod"])
def test_executor_without_the_package_fails_with_one_line_naming_host_interpreter_and_fix(absent):
    entry = executors.task_entry(b"spec", ERROR_MARKER, "spark_task")
    out = subprocess.run([sys.executable, "-c", WITHOUT_PACKAGE, absent], input=spark_cloudpickle.dumps(entry),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    failure = parse_failure(out.stdout.decode())
    assert failure is not None, out.stdout.decode()
    assert "\n" not in failure.message
    assert failure.message.startswith("The executor on host %s runs %s (Python " % (socket.gethostname(), sys.executable))
    assert "cannot import %s (No module named '%s" % (absent, absent) in failure.message
    for fix in ("PYSPARK_PYTHON", "spark.pyspark.python", "spark.archives", "image"):
        assert fix in failure.message
    assert failure.host == socket.gethostname()


def test_worker_that_cannot_import_before_the_check_is_named_from_spark_error():
    error = ("org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 1.0 failed 1 times, "
             "most recent failure: Lost task 0.0 in stage 1.0 (TID 1) (10.0.0.7 executor 3): "
             "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
             "  File \"/x/pyspark/worker.py\", line 1, in main\nModuleNotFoundError: No module named 'pyarrow'\n"
             "\tat org.apache.spark.api.python.BasePythonRunner...")
    text = executors.missing_module_text(error, "/usr/bin/python3")
    assert text.startswith("The executor on host 10.0.0.7 runs /usr/bin/python3, which cannot import pyarrow")
    assert executors.missing_module_text("Job aborted: ValueError: boom", "python3") is None
