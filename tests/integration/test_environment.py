"""The environment is real: Horovod with PyTorch, MPI and Gloo; Airflow sees the provider; Spark
runs a barrier stage with allGather."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_horovod import builder
from airflow_provider_horovod.runner import environment

BIN = Path(sys.executable).parent
HERE = Path(__file__).parent


def test_horovod_build_has_pytorch_mpi_and_gloo_and_tensorflow_with_the_extra():
    with_tensorflow = importlib.util.find_spec("tensorflow") is not None  # scripts/setup --with tensorflow
    frameworks = ("torch", builder.TENSORFLOW) if with_tensorflow else ("torch",)
    # each framework's extension, asked by Horovod's own mpi_built() and gloo_built() (the builder's check)
    assert builder.built_with(frameworks) == {f: {"MPI": True, "Gloo": True} for f in frameworks}
    # what every barrier task reports, read from the files: the same
    build = environment.horovod_build()
    assert build.controllers == ("MPI", "Gloo")
    assert [f.split()[0] for f in build.frameworks] == ["pytorch"] + (["tensorflow"] if with_tensorflow else [])


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_horovodrun_runs_allreduce_and_a_distributed_optimizer_step(controller):
    env = dict(os.environ, PATH="%s:%s" % (BIN, os.environ["PATH"]))
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", controller, sys.executable,
                           str(HERE / "horovodrun_step.py")], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if "RESULT " in l)
    # mpirun's --tag-output may glue the next output's tag onto the line: read the one JSON object.
    result, _ = json.JSONDecoder().raw_decode(line.split("RESULT ", 1)[1])
    assert result == {"size": 2, "sum": 3.0, "same_weights": True}


def test_airflow_lists_the_provider(tmp_path):
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    proc = subprocess.run([str(BIN / "airflow"), "providers", "get", "airflow-provider-horovod", "--full", "-o", "json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    info = info[0] if isinstance(info, list) else info
    text = json.dumps(info)
    assert info["package-name"] == "airflow-provider-horovod"
    assert info["hooks"][0]["python-modules"] == ["airflow_provider_horovod.hooks.horovod"]
    assert info["operators"][0]["python-modules"] == ["airflow_provider_horovod.operators.horovod"]
    assert info["task-decorators"] == [{"name": "horovod", "class-name": "airflow_provider_horovod.decorators.horovod.horovod_task"}]
    assert sorted(info["extra-links"]) == ["airflow_provider_horovod.links.HorovodTimelineLink",
                                           "airflow_provider_horovod.links.MlflowRunLink",
                                           "airflow_provider_horovod.links.SparkUILink"]
    assert "artifact_root" in text
    assert info["plugins"] == [{"name": "horovod", "plugin-class": "airflow_provider_horovod.plugins.horovod.HorovodPlugin"}]


@pytest.mark.parametrize("lazy_discover_providers", ["True", "False"])
def test_airflow_loads_the_horovod_view_plugin_once(tmp_path, lazy_discover_providers):
    """Through the entry point by default, through the provider info with lazy discovery off; never twice."""
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS=lazy_discover_providers)
    code = ("import json; from airflow import plugins_manager as pm; plugins, errors = pm._get_plugins(); "
            "print(json.dumps({'plugins': [p.name for p in plugins], 'errors': errors}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"plugins": ["horovod"], "errors": {}}


def test_barrier_stage_with_all_gather_runs_on_local_2(spark):
    def task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        ctx = BarrierTaskContext.get()
        gathered = ctx.allGather(str(ctx.partitionId()))
        yield pa.RecordBatch.from_pylist([{"partition": ctx.partitionId(), "seen": ",".join(sorted(gathered))}])

    rows = spark.range(2, numPartitions=2).mapInArrow(task, "partition long, seen string", barrier=True).collect()
    assert sorted((r.partition, r.seen) for r in rows) == [(0, "0,1"), (1, "0,1")]
