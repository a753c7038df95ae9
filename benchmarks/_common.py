"""What every benchmark script shares: a warm embedded Spark session."""

from __future__ import annotations

import os
import sys


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
