"""What a newcomer gets wrong, refused (or fixed) on the driver before Spark starts: helpers beside
the DAG file, a local master too small for np, TensorFlow without a TensorFlow-enabled Horovod, a
resume path that does not exist."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.exceptions import ArtifactError, PayloadError
from airflow_provider_horovod.runner.driver.attempt import fixed_slots
from airflow_provider_horovod.runner.environment import horovod_build, require_framework
from airflow_provider_horovod.runner.payload import build_payload

ROOT = Path(__file__).resolve().parents[4]


def dag_folder(tmp_path: Path, monkeypatch, files: dict[str, str], name: str):
    """A DAG folder on the driver's sys.path (as Airflow puts it) with ``files``; ``name`` imported."""
    folder = tmp_path / "dags"
    for file, text in files.items():
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(folder))
    for module in [m for m in sys.modules if m.split(".")[0] in {Path(f).stem for f in files}]:
        monkeypatch.delitem(sys.modules, module)
    return importlib.import_module(name)


HELPERS = {
    "my_helpers/__init__.py": "",
    "my_helpers/scaling.py": "import my_helpers.units as units\n\ndef scale(x):\n    return units.factor() * x\n",
    "my_helpers/units.py": "def factor():\n    return 3\n",
    "my_model.py": "class Model:\n    def fit(self, x):\n        return x + 1\n",
    "my_dag.py": """\
        import my_model
        from my_helpers.scaling import scale

        def train(x):
            return my_model.Model().fit(scale(x))

        def train_importing_inside(x):
            import my_model
            return my_model.Model().fit(x)
        """,
}


def test_helpers_beside_the_dag_file_travel_by_value_and_run_where_that_folder_is_not(tmp_path, monkeypatch):
    dag = dag_folder(tmp_path, monkeypatch, HELPERS, "my_dag")
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(build_payload(dag.train, (4,)))
    # an executor: this repository importable, the DAG folder not
    code = ("import sys; from airflow_provider_horovod.runner.payload import load_payload; "
            "fn, args, kw = load_payload(open(sys.argv[1], 'rb').read()); print(fn(*args, **kw))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(payload)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "13", out.stderr  # 3 * 4 + 1


def test_a_helper_imported_inside_the_function_is_refused_with_the_fix(tmp_path, monkeypatch):
    dag = dag_folder(tmp_path, monkeypatch, HELPERS, "my_dag")
    with pytest.raises(PayloadError, match=r"imports 'my_model' .* inside a function.*Import it at the top of my_dag.py"):
        build_payload(dag.train_importing_inside, (1,))


def test_building_the_payload_of_a_function_that_imports_a_framework_inside_imports_nothing_on_the_driver():
    """The check of imports inside the function looks modules up without importing them: finding
    ``horovod.tensorflow.keras``'s spec would import TensorFlow on the driver (seconds, a GB)."""
    code = textwrap.dedent("""
        import sys
        from airflow_provider_horovod.runner.payload import build_payload

        def train():
            import horovod.tensorflow.keras as hvd
            import tensorflow as tf
            return hvd, tf

        build_payload(train)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras")
                     or m.startswith("horovod.tensorflow")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("master", "fixed"), [("local", True), ("local[2]", True), ("local[*]", True),
                                                ("local[2,3]", True), ("local-cluster[2,1,1024]", False),
                                                ("spark://h:7077", False), ("yarn", False), (None, False)])
def test_only_a_local_master_has_slots_that_never_grow(master, fixed):
    assert fixed_slots(master) is fixed


def horovod_without_tensorflow(tmp_path: Path) -> Path:
    """This venv's Horovod as a torch-only build installs it: every file but TensorFlow's extension."""
    real = Path(importlib.util.find_spec("horovod").origin).parent
    site = tmp_path / "site"
    (site / "horovod" / "tensorflow").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "tensorflow":
            (site / "horovod" / entry.name).symlink_to(entry)
    for entry in (real / "tensorflow").iterdir():
        if not entry.name.startswith("mpi_lib"):
            (site / "horovod" / "tensorflow" / entry.name).symlink_to(entry)
    return site


def test_a_tensorflow_function_without_a_tensorflow_horovod_fails_before_spark_with_our_install_command(tmp_path):
    (tmp_path / "train_tf.py").write_text(textwrap.dedent("""\
        def train():
            import horovod.tensorflow.keras as hvd
            hvd.init()
        """))
    code = textwrap.dedent("""\
        import sys, train_tf
        from airflow_provider_horovod import HorovodRunner
        from airflow_provider_horovod.runner.environment import horovod_build
        print(horovod_build().describe())
        try:
            HorovodRunner(-2).run(train_tf.train)
        except Exception as err:
            print(type(err).__name__, err)
        print("spark:", "pyspark.sql" in sys.modules)
        """)
    site = horovod_without_tensorflow(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    lines = out.stdout.splitlines()
    assert lines and "pytorch" in lines[0] and "tensorflow" not in lines[0], out.stdout + out.stderr
    assert "TrainingStackError train_tf.train uses horovod.tensorflow.keras, but the Horovod in" in out.stdout
    assert "built without TensorFlow" in out.stdout and "\\x0a" not in out.stdout
    assert "pip install 'airflow-provider-horovod[tensorflow]' then airflow-horovod build --with tensorflow" in out.stdout
    assert lines[-1] == "spark: False"


def test_this_venvs_tensorflow_horovod_lets_a_tensorflow_function_through():
    build = horovod_build()
    assert any(f.startswith("tensorflow ") for f in build.frameworks)  # scripts/test sets up the tensorflow extra
    require_framework(build, {"tensorflow", "horovod.tensorflow.keras"}, "train")
    require_framework(None, {"tensorflow"}, "train")  # launcher="torch": no Horovod to check


def test_resume_from_a_missing_folder_says_it_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="resume_from=.*/nope does not exist"):
        HorovodRunner(2, resume_from=tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        HorovodRunner(2, resume_from=tmp_path / "file")


def test_resume_uri_at_a_missing_path_says_it_does_not_exist(tmp_path):
    from airflow_provider_horovod import store

    for missing in ("dag/run/task/try-3", "dag/run/task/try-3/checkpoints", "elsewhere"):
        with pytest.raises(ArtifactError, match="it does not exist"):
            store.checkpoint_at(str(tmp_path / missing), roots=[str(tmp_path)])


SPARK_LOST = "Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times, most recent failure: Lost task 0.0 in stage 3.0 (TID 7) (worker-3.example executor 1): org.apache.spark.api.python.PythonException: "


@pytest.mark.parametrize(("spark_says", "ours"), [
    (SPARK_LOST + "[PYTHON_VERSION_MISMATCH] Python in worker has different version: 3.10 than that in driver: "
     "3.11, PySpark cannot run with different minor versions.",
     "Python 3.10 on the executors (host worker-3.example, executor 1) differs from the driver's 3.11."),
    ("Exception: Python in worker has different version (3, 10) than that in driver 3.11, PySpark cannot run",
     "Python 3.10 on the executors differs from the driver's 3.11."),
])
def test_the_executors_python_version_is_said_in_our_words_with_the_host(spark_says, ours):
    from airflow_provider_horovod.runner.driver.attempt import python_mismatch_text

    said = python_mismatch_text(spark_says, "3.11")
    assert said.startswith(ours) and "PYSPARK_PYTHON" in said and "another version" not in said
    assert python_mismatch_text("java.lang.OutOfMemoryError", "3.11") is None
