"""The code blocks of the README, the how-to and the first-DAG page are valid as written, and their
DAGs parse into DAGs.
(``tests/integration/test_doc_snippets.py`` runs the engine examples on real Spark.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.snippets import FIRST_DAG, HOW_TO, README, blocks, files, section_code

PARSE = """
import json, sys
from pathlib import Path
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder=sys.argv[1], bundle_path=Path(sys.argv[1]))  # as the DAG processor: the folder on sys.path
print(json.dumps({"tasks": {d: sorted(bag.dags[d].task_ids) for d in bag.dag_ids},
                  "errors": {k: str(v) for k, v in bag.import_errors.items()}}))
"""
# what the how-to's section 8 leaves to the reader: the imports and a DAG that calls the task
DATASET_DAG = """from airflow.sdk import dag, task

{snippet}

@dag(schedule=None)
def dataset_training():
    train(epochs=2)

dataset_training()
"""


def _parse(tmp_path, dag_files: dict[str, str]) -> dict:
    folder = tmp_path / "dags"
    folder.mkdir()
    for name, code in dag_files.items():
        (folder / name).write_text(code)
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__UNIT_TEST_MODE": "True", "AIRFLOW__CORE__DAGS_FOLDER": str(folder)}
    proc = subprocess.run([sys.executable, "-c", PARSE, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", blocks(README, "python") + blocks(HOW_TO, "python") + blocks(FIRST_DAG, "python"),
                         ids=lambda b: "%s:%d" % (b.section[:20] or "intro", len(b.code)))
def test_every_python_snippet_compiles(block):
    compile(block.code, block.section or "README", "exec")


def test_every_json_snippet_is_json():
    for block in blocks(HOW_TO, "json") + blocks(README, "json"):
        json.loads(block.code)


def test_the_docs_dag_snippets_parse_into_their_dags(tmp_path):
    """The how-to's DAGs, and the first-DAG page's DAG file with the helper module beside it (one
    parse of one DAGs folder for all: the Airflow import is most of the cost)."""
    dag_snippet = section_code(HOW_TO, "3.")[0]
    dataset_snippet = section_code(HOW_TO, "8.")[0]
    first_dag = {Path(name).name: code for name, code in files(FIRST_DAG).items() if name.startswith("dags/")}
    assert set(first_dag) == {"first_model.py", "first_training.py"}
    parsed = _parse(tmp_path, {"training.py": dag_snippet,
                               "dataset_training.py": DATASET_DAG.format(snippet=dataset_snippet), **first_dag})
    assert parsed["errors"] == {}
    assert parsed["tasks"] == {"training": ["train"], "dataset_training": ["train"],
                               "first_training": ["evaluate", "train"]}


def test_the_first_dag_page_is_linked_from_the_readme_and_its_files_are_the_ones_it_names():
    assert "(docs/first-dag.md)" in README.read_text()
    assert set(files(FIRST_DAG)) == {"dags/first_model.py", "dags/first_training.py", "tests/test_first_model.py"}
