"""The README's engine example and the how-to's training function and engine snippets run as
written, taken from the Markdown (so they cannot drift), in a fresh process with no
PYSPARK_PYTHON: the session the engine creates gives its executors the driver's interpreter."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from tests.snippets import FIRST_DAG, HOW_TO, MIGRATING, README, blocks, files, section_code

pytestmark = pytest.mark.slow

# what a new user's shell has: none of the test session's Spark settings
USER_ENV = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}


def _run_script(tmp_path, code: str) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=USER_ENV, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_readme_engine_example_runs_as_written(tmp_path):
    example = blocks(README, "python")[0].code
    out = _run_script(tmp_path, example + "\nprint('LOSS', type(loss).__name__, loss)\n")
    assert "LOSS float " in out


def test_how_to_training_function_and_engine_snippets_run_as_written(tmp_path):
    train = section_code(HOW_TO, "2.")[0]
    engine = section_code(HOW_TO, "6.")[0]
    checks = """
from pathlib import Path
assert result["epochs"] == 8 and isinstance(result["loss"], float), result
assert (Path(runner.last_run.checkpoint_path) / "model.pt").is_file()
assert Path(runner.last_run.timeline_path).is_file()
print("CHECKED")
"""
    out = _run_script(tmp_path, train + "\n" + engine + checks)
    assert "CHECKED" in out


def test_how_to_torch_function_runs_with_the_engine_as_written(tmp_path):
    """Section 10's torchrun-style function with the engine's np < 0 line, as printed (two ranks on the driver:
    no Spark start; np = 2 on Spark runs the same function in test_torch_launcher.py)."""
    function, engine = section_code(HOW_TO, "10.")[:2]
    [local_line] = [line for line in engine.splitlines() if line.startswith("HorovodRunner(-2")]
    checks = """
result = %s
assert result["epochs"] == 1 and isinstance(result["loss"], float), result
print("CHECKED")
""" % local_line.split("#")[0].strip()
    out = _run_script(tmp_path, function + "\nfrom airflow_provider_horovod import HorovodRunner\n" + checks)
    assert "CHECKED" in out


def test_the_migration_pages_mnist_notebook_runs_with_only_the_import_changed_and_keeps_its_model(
        tmp_path, monkeypatch):
    """np < 0 with log_callback_only, as sparkdl's local mode: every rank's prints still show. The model
    rank 0 saves is kept after the run under the default root (a user's ``~/.cache``: here
    ``XDG_CACHE_HOME``), as ``/dbfs`` kept it, and the run's last line says where."""
    notebook = blocks(MIGRATING, "python")[0].code
    assert "from sparkdl import HorovodRunner" in notebook  # the line it replaces, said beside it
    monkeypatch.setitem(USER_ENV, "XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delitem(USER_ENV, "HVDRUNNER_RUNS_DIR", raising=False)  # the default root, as a user has it
    out = _run_script(tmp_path, notebook + "\nassert isinstance(loss, float), loss\n"
                                           "print('MODEL', hr.last_run.checkpoint_path)\n")
    assert "[rank 0] epoch 1 loss" in out and "[rank 1] epoch 1 loss" in out
    (kept,) = (tmp_path / "cache" / "airflow-provider-horovod" / "runs").iterdir()
    assert "kept its checkpoints in %s" % kept in out and "MODEL %s" % (kept / "checkpoints") in out
    import torch

    assert set(torch.load(kept / "checkpoints" / "model.pt")) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_the_first_dag_pages_unit_test_of_the_training_step_passes_as_written(tmp_path, monkeypatch):
    """docs/first-dag.md's test of the training step alone (no Spark), imported as its pytest
    would (``-o pythonpath=dags``). Its other test runs first_model.train through the engine on a
    new Spark (about 20 s): the same function with the same dataset= runs in this suite under
    ``airflow dags test`` (test_airflow_dags.py), so only its being collected is checked here."""
    for name, code in files(FIRST_DAG).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "dags"))
    monkeypatch.syspath_prepend(str(tmp_path / "tests"))
    for module in ("first_model", "test_first_model"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        tests = importlib.import_module("test_first_model")
        assert tests.first_model.__file__ == str(tmp_path / "dags" / "first_model.py")
        assert callable(tests.test_train_reads_its_shard_and_saves_the_model)
        tests.test_fit_learns_the_line()
    finally:
        for module in ("first_model", "test_first_model"):
            sys.modules.pop(module, None)
