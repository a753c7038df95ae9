"""The hook's own Spark JVM: its conf (``spark.authenticate.secret``, store keys) is on no command
line yet still reaches Spark, and the embedded ``local[2]`` fallback has no UI and listens on
loopback only, even with ``SPARK_LOCAL_IP`` unset. Findings N5 and N6 of issue #21, on a real JVM."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

# Survives a Java properties file: separators, comment marks, a backslash, non-ASCII.
AWKWARD = "a=b:c #d !e \\f ü"

# A task process with no spark_default connection: the hook falls back to the embedded Spark.
TASK = textwrap.dedent("""
    import json, os, sys, psutil
    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
    secret, awkward = sys.argv[1], sys.argv[2]
    hook = HorovodRunnerHook(spark_conf={"spark.authenticate": "true", "spark.authenticate.secret": secret,
                                         "spark.hadoop.fs.s3a.secret.key": secret, "spark.driver.memory": "700m",
                                         "spark.hvd.awkward": awkward})
    spark = hook.get_conn()
    jvms = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    system = spark.sparkContext._jvm.java.lang.System
    print("RESULT " + json.dumps({
        "cmdlines": {p.pid: open("/proc/%d/cmdline" % p.pid, "rb").read().decode().split("\\0") for p in jvms},
        "listening": sorted({c.laddr.ip for p in jvms for c in p.net_connections("inet") if c.status == "LISTEN"}),
        "ui": spark.sparkContext.uiWebUrl,
        "conf_secret": spark.conf.get("spark.authenticate.secret"),
        "jvm_secret": system.getProperty("spark.authenticate.secret"),
        "jvm_awkward": system.getProperty("spark.hvd.awkward"),
        "submit_args": os.environ.get("PYSPARK_SUBMIT_ARGS"),
        "count": spark.range(10).count(),
    }))
""")


def test_the_embedded_spark_keeps_its_secrets_off_argv_and_its_ports_on_loopback(tmp_path):
    secret = "s3cr3t-" + secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "AIRFLOW_CONN_SPARK_DEFAULT", "PYSPARK_SUBMIT_ARGS")}
    env["AIRFLOW_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", TASK, secret, AWKWARD], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    java = [argv for argv in got["cmdlines"].values() if "org.apache.spark.deploy.SparkSubmit" in argv]
    assert len(java) == 1, got["cmdlines"]
    assert [a for argv in got["cmdlines"].values() for a in argv if secret in a] == []  # the review: --conf ...secret=
    assert "-Xmx700m" in java[0]  # spark-submit read the conf file: launch-time conf still takes effect
    assert got["jvm_secret"] == got["conf_secret"] == secret and got["jvm_awkward"] == AWKWARD
    assert got["count"] == 10  # authentication on, and Spark runs
    properties = java[0][java[0].index("--properties-file") + 1]
    assert not os.path.exists(properties) and got["submit_args"] is None  # nothing left behind in the task
    assert got["ui"] is None  # the review: :4040 open to every local user, kill enabled
    assert got["listening"] and set(got["listening"]) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
