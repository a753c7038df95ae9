"""The example DAGs parse cleanly and touch no Spark, Horovod, torch, TensorFlow or connection at parse time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
heavy = sorted(m for m in ("pyspark.sql", "horovod.torch", "torch", "sklearn", "tensorflow", "tf_keras", "keras", "horovod.tensorflow") if m in sys.modules)
print(json.dumps({"dags": sorted(bag.dag_ids), "errors": {k: str(v) for k, v in bag.import_errors.items()}, "heavy": heavy}))
"""


def test_example_dags_parse_without_importing_spark_horovod_torch_or_tensorflow(tmp_path):
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__UNIT_TEST_MODE": "True"}
    proc = subprocess.run([sys.executable, "-c", PARSE, str(REPO / "dags")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["errors"] == {}
    assert parsed["dags"] == ["horovod_digits_retrain", "horovod_digits_train", "horovod_keras_digits"]
    assert parsed["heavy"] == []
