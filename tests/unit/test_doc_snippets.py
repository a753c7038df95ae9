"""The README's and the how-to's code blocks are valid as written, and its DAGs parse into DAGs.
(``tests/integration/test_doc_snippets.py`` runs the engine examples on real Spark.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.snippets import HOW_TO, README, blocks, section_code

PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
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


def _parse(tmp_path, files: dict[str, str]) -> dict:
    folder = tmp_path / "dags"
    folder.mkdir()
    for name, code in files.items():
        (folder / name).write_text(code)
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__UNIT_TEST_MODE": "True"}
    proc = subprocess.run([sys.executable, "-c", PARSE, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", blocks(README, "python") + blocks(HOW_TO, "python"),
                         ids=lambda b: "%s:%d" % (b.section[:20] or "intro", len(b.code)))
def test_every_python_snippet_compiles(block):
    compile(block.code, block.section or "README", "exec")


def test_every_json_snippet_is_json():
    for block in blocks(HOW_TO, "json") + blocks(README, "json"):
        json.loads(block.code)


def test_how_to_dag_snippets_parse_into_their_dags(tmp_path):
    dag_snippet = section_code(HOW_TO, "3.")[0]
    dataset_snippet = section_code(HOW_TO, "8.")[0]
    parsed = _parse(tmp_path, {"training.py": dag_snippet,
                               "dataset_training.py": DATASET_DAG.format(snippet=dataset_snippet)})
    assert parsed["errors"] == {}
    assert parsed["tasks"] == {"training": ["train"], "dataset_training": ["train"]}
