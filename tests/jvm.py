"""The options of every Spark driver JVM the suite starts (``SPARK_SUBMIT_OPTS``): the embedded
sessions, ``airflow dags test``, the deployment's tasks and the subprocess tests all inherit them.

- ``-XX:TieredStopAtLevel=1``: the client compiler only. These JVMs live seconds, and the server
  compiler's background work took the 2 cores from the ranks. A ``local[2]`` session plus one
  barrier job: 15.3-17.3 s -> 13.8-14.1 s (helper benchmark, load ~2).
- ``-XX:SharedArchiveFile``: the classes a session and a barrier job load, archived once per
  virtualenv, PySpark and JDK (AppCDS), so each JVM maps them instead of parsing and verifying them
  from Spark's jars again: a ``local[2]`` session plus one job, 16.1-17.4 s -> 7.6-8.8 s (load
  1.4-1.6). The archive is made by a throwaway session the first time (30-46 s here). A JVM whose class
  path differs (another ``SPARK_CONF_DIR``, another PySpark) or that finds the jars changed ignores
  it and starts as before; ``-Xlog:cds`` is off so that says nothing in the logs the tests read.

The standalone clusters' masters, workers (``SPARK_DAEMON_JAVA_OPTS``) and executors
(``executor_conf``) get the same options.

No behaviour depends on either option.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Set with SPARK_SUBMIT_OPTS when they are this module's, not the user's: the same options.
OURS = "HVDRUNNER_TEST_JVM_OPTS"
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
WARM_UP = """
from pyspark import BarrierTaskContext
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").appName("class-data-archive").getOrCreate()
spark.range(1000).selectExpr("id % 7 AS k").groupBy("k").count().collect()
def gather(rows):
    ctx = BarrierTaskContext.get()
    ctx.allGather(str(ctx.partitionId()))
    ctx.barrier()
    yield ctx.partitionId()
spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(gather).collect()
spark.stop()
"""


def archive() -> Path | None:
    """This virtualenv's archive for its PySpark and the JDK ``pyspark`` starts, or None without a JDK."""
    import pyspark

    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else shutil.which("java")
    if java is None or not Path(java).exists():
        return None
    real = Path(java).resolve()
    key = hashlib.sha256(("%s %s %s" % (pyspark.__version__, real, real.stat().st_mtime)).encode()).hexdigest()[:12]
    return Path(sys.prefix) / "spark-cds" / ("pyspark-%s-%s.jsa" % (pyspark.__version__, key))


def make_archive(path: Path) -> bool:
    """Run the warm-up session with ``-XX:ArchiveClassesAtExit``; the archive appears whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".making-", suffix=".jsa")
    os.close(fd)
    os.unlink(tmp)
    env = dict(os.environ, SPARK_SUBMIT_OPTS="-XX:TieredStopAtLevel=1 -XX:ArchiveClassesAtExit=%s %s" % (tmp, QUIET))
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        done = subprocess.run([sys.executable, "-c", WARM_UP], env=env, capture_output=True, timeout=300)
        if done.returncode == 0 and os.path.getsize(tmp) > 0:
            os.replace(tmp, path)
            return True
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return False


def environment() -> dict[str, str]:
    """``SPARK_SUBMIT_OPTS`` and ``SPARK_DAEMON_JAVA_OPTS`` (the standalone clusters' masters and
    workers) for this session, and ``OURS``, making the archive first if it is missing; a variable
    the user set is left as it is."""
    if os.environ.get("SPARK_SUBMIT_OPTS") and OURS not in os.environ:
        return {}
    options = " ".join(["-XX:TieredStopAtLevel=1", archive_options()]).strip()
    env = {"SPARK_SUBMIT_OPTS": options, OURS: options}
    if not os.environ.get("SPARK_DAEMON_JAVA_OPTS") or OURS in os.environ:
        env["SPARK_DAEMON_JAVA_OPTS"] = options
    return env


def executor_conf() -> dict[str, str]:
    """Spark conf that gives a standalone cluster's executors the drivers' options (their class path
    is the driver's): with the archive, an application and its first job on two workers took
    22.5-23.5 s -> 16.7-17.6 s; with the client compiler too, ``test_cluster.py``'s cluster fixture
    92.8 -> 73.2 s (helper's measurement, one run each, load 1.2-3.2)."""
    options = os.environ.get(OURS)
    return {"spark.executor.extraJavaOptions": options} if options else {}


def archive_options() -> str:
    """The JVM options that use the archive (made first if missing), or "" without one. One process
    makes it (under a file lock beside it); any other that needs it meanwhile waits and finds it made."""
    path = archive()
    if path is None:
        return ""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".making.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                print("\nMaking the class-data archive of Spark's driver JVM, once per virtualenv (30-46 s here): %s"
                      % path, file=sys.stderr, flush=True)
                if not make_archive(path):
                    print("No archive could be made; the driver JVMs start without it.", file=sys.stderr, flush=True)
    return "-XX:SharedArchiveFile=%s %s" % (path, QUIET) if path.exists() else ""
