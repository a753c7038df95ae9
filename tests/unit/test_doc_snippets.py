"""The code blocks of the README, the how-to and the first-DAG page are valid as written, and their
DAGs parse into DAGs.
(``tests/integration/test_doc_snippets.py`` runs the engine examples on real Spark.)"""

from __future__ import annotations

import json
import os
import re
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


# -- every how-to block that says what running it does is run by a test -----------------------------------------
# A block is named by its section's number and its first line. RUN: the test that runs it as printed (or reads the
# output it shows from a real run). SHOWN_ONLY: blocks that claim no outcome of their own, or one that needs what
# this machine lacks; each says why, and that it compiles is checked above.
RUN = {
    ("2.", "def train(epochs: int):"):
        "tests/integration/test_doc_snippets.py::test_how_to_training_function_and_engine_snippets_run_as_written",
    ("3.", "from airflow.sdk import Asset, dag, task"):
        "tests/unit/test_doc_snippets.py::test_the_docs_dag_snippets_parse_into_their_dags",
    ("4.", "from datetime import timedelta"):
        "tests/unit/test_doc_snippets.py::test_the_how_tos_retry_policy_snippet_decides_as_its_text_says",
    ("4.", "stalled: rank 1 never submitted allreduce.grad.step (waited 4 s); rank 1 in user code at "
           "sleeps_in_user_code (jobs.py:383); rank 0 waits in allreduce (called at collective (jobs.py:408)) "
           "(no rank made progress for 4 s)"):
        "tests/integration/test_stall.py::test_a_rank_that_stalls_at_step_3_fails_the_try_naming_it_and_where_it_is",
    ("6.", "from airflow_provider_horovod import HorovodRunner"):
        "tests/integration/test_doc_snippets.py::test_how_to_training_function_and_engine_snippets_run_as_written",
    ("7.", "horovod.tensorflow.keras.DistributedOptimizer was given a Keras 3 object, "
           "keras.src.optimizers.sgd.SGD"):
        "tests/unit/runner/rank/test_keras_guard.py::test_keras_3_objects_are_refused_and_tf_keras_objects_train",
    ("8.", "@task.horovod(np=2, dataset=\"SELECT pixels, label FROM parquet.`/data/digits` WHERE day <= '{{ ds }}'\")"):
        "tests/unit/test_doc_snippets.py::test_the_docs_dag_snippets_parse_into_their_dags",
    ("10.", "def train(epochs: int, lr: float = 0.05):"):
        "tests/integration/test_doc_snippets.py::test_how_to_torch_function_runs_with_the_engine_as_written",
    ("10.", "from airflow_provider_horovod import HorovodRunner"):
        "tests/integration/test_doc_snippets.py::test_how_to_torch_function_runs_with_the_engine_as_written",
}
SHOWN_ONLY = {
    ("1.", "import horovod.torch as hvd"): "needs a GPU (CUDA_VISIBLE_DEVICES from Spark's GPU resources)",
    ("3.", "trained = train(epochs=8)                               # rank 0's return value"):
        "two lines of section 3's DAG, which is parsed",
    ("4.", "@task.horovod(np=8, min_np=4, launcher=\"torch\")"):
        "needs 8 slots and a lost executor; the shrunken restart it relies on is test_restarts.py's",
    ("7.", "def train(epochs: int):"):
        "an excerpt of dags/horovod_keras_digits.py, which test_airflow_dags.py trains to its accuracy",
    ("9.", "@task.horovod(np=2, progress_interval=10, mlflow_conn_id=\"mlflow_default\")"):
        "needs an MLflow server; test_airflow_dags.py's MLflow test runs the same calls against a real one",
    ("10.", "torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))   # or: torch.cuda.set_device(runtime.device())"):
        "needs a GPU",
    ("10.", "# before"): "needs GPUs (use_gpu=True); the function it passes is section 10's, run above",
    ("10.", "# my_pkg/train.py"): "a module of the reader's package (my_pkg)",
    ("10.", "HorovodRunner(8, launcher=\"torch\").run(\"my_pkg.train:main\", epochs=8, lr=0.1)"):
        "needs my_pkg and 8 slots; reference strings run in test_airflow_dags.py",
}


def _block_key(block) -> tuple[str, str]:
    return block.section.split(" ", 1)[0], block.code.strip().splitlines()[0]


def test_every_how_to_code_block_is_run_by_a_test_or_says_why_not():
    """A new block that claims an outcome gets a test that runs it; one that cannot run here says why."""
    found = [_block_key(b) for b in blocks(HOW_TO) if b.lang in ("python", "")]
    assert len(found) == len(set(found)), "two blocks share a name: give one another first line"
    assert set(RUN).isdisjoint(SHOWN_ONLY)
    assert sorted(set(found) - set(RUN) - set(SHOWN_ONLY)) == [], "classify these how-to blocks in RUN or SHOWN_ONLY"
    assert sorted((set(RUN) | set(SHOWN_ONLY)) - set(found)) == [], "these blocks are no longer in the how-to"
    repo = Path(__file__).resolve().parents[2]
    for where in set(RUN.values()):
        path, name = where.split("::")
        assert re.search(r"^def %s\(" % name, (repo / path).read_text(), re.M), "%s does not exist" % where


def test_the_how_tos_retry_policy_snippet_decides_as_its_text_says():
    """Section 4's own delays and fallback: too few slots after 15 minutes, a lost host after 60 s, a store's
    ClientError after 2 minutes (the fallback), a bug never."""
    from datetime import timedelta

    from airflow.sdk import DAG, RetryAction

    from airflow_provider_horovod.exceptions import HorovodRunError, InsufficientSlotsError
    from airflow_provider_horovod.runner.events import Failure

    from airflow.sdk import task

    [snippet] = [b.code for b in blocks(HOW_TO, "python") if b.code.startswith("from datetime import timedelta")]
    namespace: dict = {"task": task}
    exec(compile(snippet, "how-to section 4", "exec"), namespace)
    with DAG("retry_snippet", schedule=None) as dag:
        namespace["train"]()
    [operator] = dag.tasks
    policy = operator.retry_policy
    lost = HorovodRunError("Rank 1 died")
    lost.failure = Failure("Rank 1 died", rank=1, exit="was killed by SIGKILL").to_json()
    assert policy.evaluate(InsufficientSlotsError("np=8"), 1, 4).retry_delay == timedelta(minutes=15)
    assert policy.evaluate(lost, 1, 4).retry_delay == timedelta(seconds=60)
    from botocore.exceptions import ClientError

    store_error = ClientError({"Error": {"Code": "SlowDown", "Message": "slow down"}}, "PutObject")
    decision = policy.evaluate(store_error, 1, 4)
    assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, timedelta(minutes=2))
    bug = HorovodRunError("Rank 0 failed")
    bug.failure = Failure("Rank 0 failed", rank=0, exception="ValueError: bad lr").to_json()
    assert policy.evaluate(bug, 1, 4).action == RetryAction.FAIL
    assert operator.retries == 3
