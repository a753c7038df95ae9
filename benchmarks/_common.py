"""What the benchmark scripts share: a warm embedded Spark session, and the training function that
writes a checkpoint of a given size (the engine pickles it by value: this folder is not installed)."""

from __future__ import annotations

import os
import sys


def print_load(when: str) -> None:
    """The 1/5/15-minute load average ``when`` ("at the start", "at the end"): other work on the
    machine skews every number, so each figure is read beside it."""
    print("load average %s: %.2f %.2f %.2f" % ((when,) + os.getloadavg()), flush=True)


def warm_local_session(app_name: str):
    """A ``local[2]`` SparkSession with its JVM and Python workers already started."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(4, numPartitions=2).collect()  # start the JVM side and the Python workers
    return spark


def write_checkpoint(mib: int, versions: bool = True) -> int:
    """Rank 0 writes a ``mib`` MiB checkpoint (temporary name, then a rename). ``versions=False``:
    the run first commits a folder holding one small file as its one version
    (``runtime.commit_checkpoint``), so the rename ships nothing during the run and only the final
    hand-over carries the checkpoint."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == 0:
        if not versions:
            (runtime.checkpoint_dir() / "started.txt").write_text("started")
            runtime.commit_checkpoint()
        block = os.urandom(1 << 20)
        target = runtime.checkpoint_dir() / "model.bin"
        with open(str(target) + ".tmp", "wb") as f:
            for _ in range(mib):
                f.write(block)
        os.replace(str(target) + ".tmp", target)
        os.sync()  # every contender starts with no dirty pages to write back (outside the timed part)
    return mib
