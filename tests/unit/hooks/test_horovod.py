"""HorovodRunnerHook: Airflow connections (as AIRFLOW_CONN_* JSON) -> where the SparkSession goes; the artifact store."""

from __future__ import annotations

import json
import os
import re

import pytest

from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook, SparkConnectionError


@pytest.fixture(autouse=True)
def airflow_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    return tmp_path / "airflow"


def conn(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_%s" % conn_id.upper(), json.dumps(fields))


@pytest.mark.parametrize(
    ("host", "port", "master"),
    [
        ("local[3]", None, "local[3]"),
        ("local[*]", None, "local[*]"),
        ("spark://10.0.0.5:7077", None, "spark://10.0.0.5:7077"),
        ("10.0.0.5", 7077, "spark://10.0.0.5:7077"),
        ("yarn", None, "yarn"),
        ("k8s://https://kube.example:443", None, "k8s://https://kube.example:443"),
    ],
)
def test_spark_connection_host_is_the_master_url(monkeypatch, host, port, master):
    conn(monkeypatch, "spark_x", conn_type="spark", host=host, **({"port": port} if port else {}))
    target = HorovodRunnerHook("spark_x").resolve_target()
    assert (target.master, target.remote, target.embedded_fallback) == (master, None, False)


def test_extras_become_spark_conf_and_operator_conf_wins(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="yarn",
         extra={"spark.executor.memory": "4g", "spark.dynamicAllocation.enabled": False, "queue": "ml",
                "deploy-mode": "client", "spark-binary": "spark-submit", "spark.executor.cores": 2})
    target = HorovodRunnerHook("spark_x", spark_conf={"spark.executor.memory": "8g"}).resolve_target()
    assert target.conf == {
        "spark.executor.memory": "8g",
        "spark.dynamicAllocation.enabled": "false",
        "spark.yarn.queue": "ml",
        "spark.executor.cores": "2",
    }


def test_spark_connect_connection_gives_a_remote_url_with_its_token(monkeypatch):
    conn(monkeypatch, "spark_connect_x", conn_type="spark_connect", host="sc://connect.example", port=15002,
         password="tok-123456")
    target = HorovodRunnerHook("spark_connect_x").resolve_target()
    assert target.master is None
    assert target.remote == "sc://connect.example:15002/;token=tok-123456"
    assert target.where == "sc://connect.example:15002"  # what the log shows: no token


def test_missing_spark_default_falls_back_to_embedded_local_spark(monkeypatch, caplog):
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    target = HorovodRunnerHook().resolve_target()
    assert (target.master, target.embedded_fallback) == ("local[2]", True)


def test_missing_named_connection_is_an_error(monkeypatch):
    from airflow.sdk.exceptions import AirflowNotFoundException

    with pytest.raises(AirflowNotFoundException, match="spark_nowhere"):
        HorovodRunnerHook("spark_nowhere").resolve_target()


def test_extras_that_are_not_json_say_so(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]", extra="{spark.executor.memory: 4g")
    with pytest.raises(SparkConnectionError, match=r"extras of connection 'spark_x' are not valid JSON.*JSON object"):
        HorovodRunnerHook("spark_x").resolve_target()


def test_extras_that_are_a_json_list_say_so(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]", extra='["spark.executor.memory", "4g"]')
    with pytest.raises(SparkConnectionError, match="must be a JSON object.*got a JSON list"):
        HorovodRunnerHook("spark_x").resolve_target()


def test_unknown_extra_keys_are_named(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]", extra={"executor_memory": "4g", "spark.a": "1"})
    with pytest.raises(SparkConnectionError, match="does not understand: executor_memory.*start with 'spark.'"):
        HorovodRunnerHook("spark_x").resolve_target()


@pytest.mark.parametrize(("extra", "fix"), [
    ({"keytab": "a2V5dGFi", "principal": "etl@EXAMPLE.COM"}, "as the extra 'spark.kerberos.keytab'"),
    ({"spark-home": "/opt/spark"}, "the Spark provider refuses it too"),
])
def test_spark_provider_extras_that_cannot_work_here_say_what_to_set(monkeypatch, extra, fix):
    conn(monkeypatch, "spark_x", conn_type="spark", host="yarn", extra=extra)
    with pytest.raises(SparkConnectionError, match="Connection 'spark_x' has the extra '%s': .*%s" % (
            next(iter(extra)), re.escape(fix))):
        HorovodRunnerHook("spark_x").resolve_target()


def test_nested_extra_value_is_refused(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]", extra={"spark.a": {"b": 1}})
    with pytest.raises(SparkConnectionError, match="extra 'spark.a' of connection 'spark_x' must be a string"):
        HorovodRunnerHook("spark_x").resolve_target()


def test_cluster_deploy_mode_is_refused_because_the_driver_runs_in_the_task(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="yarn", extra={"deploy-mode": "cluster"})
    with pytest.raises(SparkConnectionError, match="deploy-mode='cluster'.*driver runs inside the Airflow task.*'client'"):
        HorovodRunnerHook("spark_x").resolve_target()


@pytest.mark.parametrize("host", ["mesos://m:5050", "http://spark.example:7077", "locl[2]"])
def test_unknown_master_scheme_is_refused(monkeypatch, host):
    conn(monkeypatch, "spark_x", conn_type="spark", host=host)
    with pytest.raises(SparkConnectionError, match="cannot use. Use local\\[N\\], spark://host:port, yarn or k8s://"):
        HorovodRunnerHook("spark_x").resolve_target()


def test_connection_of_another_type_is_refused(monkeypatch):
    conn(monkeypatch, "pg", conn_type="postgres", host="db")
    with pytest.raises(SparkConnectionError, match="type 'postgres'.*'spark' connection"):
        HorovodRunnerHook("pg").resolve_target()


def test_resolving_starts_no_spark(monkeypatch):
    """In a fresh interpreter: in this one, other tests have long imported pyspark."""
    import subprocess
    import sys

    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]")
    probe = ("import sys; from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook; "
             "target = HorovodRunnerHook('spark_x').resolve_target(); "
             "print(target.master, sorted(m for m in sys.modules if m.startswith('pyspark.sql')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["local[2]", "[]"]


# -- the artifact store ----------------------------------------------------------------------------
def test_default_artifact_root_is_under_airflow_home(airflow_home):
    assert HorovodRunnerHook.default_artifact_root() == str(airflow_home / "horovod-artifacts")


def test_artifact_root_from_provider_config(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", "file://%s/store" % tmp_path)
    assert HorovodRunnerHook.default_artifact_root() == "file://%s/store" % tmp_path


def test_a_relative_artifact_root_lies_under_airflow_home_not_the_workers_current_folder(airflow_home, monkeypatch):
    """The view (in the API server) and the worker agree only on $AIRFLOW_HOME, never on a current folder."""
    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", "team/artifacts")
    monkeypatch.setenv("AIRFLOW__HOROVOD__VIEW_EXTRA_ROOTS", "old, s3://bucket/x")
    monkeypatch.chdir("/")
    assert HorovodRunnerHook.default_artifact_root() == str(airflow_home / "team" / "artifacts")
    assert HorovodRunnerHook.artifact_root("mine") == str(airflow_home / "mine")
    assert HorovodRunnerHook.artifact_root(None) == str(airflow_home / "team" / "artifacts")
    assert HorovodRunnerHook.configured_roots("view_extra_roots") == [str(airflow_home / "old"), "s3://bucket/x"]


def test_the_jvms_output_is_logged_at_its_log4j_level_not_as_errors(tmp_path):
    """The Spark JVM writes log4j lines to stderr; the task log must show a WARN as a warning."""
    import logging
    import subprocess
    import sys
    import time

    from airflow_provider_horovod.hooks.horovod import _JvmLines

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("test.jvm")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    filler = "y" * 99
    script = (
        "import sys\n"
        "print(\"Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties\", file=sys.stderr)\n"
        "print('26/12/03 04:18:07 WARN NativeCodeLoader: Unable to load native-hadoop library', file=sys.stderr)\n"
        "print('26/12/03 04:18:08 ERROR SparkContext: Error initializing SparkContext.', file=sys.stderr)\n"
        "print('org.apache.spark.SparkException: Job aborted due to stage failure', file=sys.stderr)\n"
        "print('\\tat org.apache.spark.SparkContext.<init>(SparkContext.scala:1)', file=sys.stderr)\n"
        "print('Caused by: java.net.ConnectException: Connection refused', file=sys.stderr)\n"
        "print('\\t... 12 more', file=sys.stderr)\n"
        "print('26/12/03 04:18:09 INFO Executor: Starting executor')\n"
        "sys.stdout.write(%r * 1000)\n" % (filler + "\n")  # 100 KB, more than a pipe holds
    )
    out = tmp_path / "jvm.log"
    with out.open("wb") as sink:
        lines = _JvmLines(os.open(out, os.O_RDONLY), logger)
        lines.start()  # following from the start, as start_jvm does
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=sink, stderr=sink)
        assert proc.wait(30) == 0
    try:
        deadline = time.monotonic() + 10
        while sum(r.getMessage() == filler for r in records) < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        logger.removeHandler(handler)
    levels = {r.getMessage(): r.levelname for r in records}
    assert levels["Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties"] == "INFO"
    assert levels["26/12/03 04:18:07 WARN NativeCodeLoader: Unable to load native-hadoop library"] == "WARNING"
    assert levels["26/12/03 04:18:08 ERROR SparkContext: Error initializing SparkContext."] == "ERROR"
    # Spark's stack trace under it: DEBUG (the provider's error says what failed)
    assert levels["org.apache.spark.SparkException: Job aborted due to stage failure"] == "DEBUG"
    assert levels["\tat org.apache.spark.SparkContext.<init>(SparkContext.scala:1)"] == "DEBUG"
    assert levels["Caused by: java.net.ConnectException: Connection refused"] == "DEBUG"
    assert levels["\t... 12 more"] == "DEBUG"
    assert levels["26/12/03 04:18:09 INFO Executor: Starting executor"] == "INFO"
    assert sum(r.getMessage() == filler for r in records) == 1000


def test_history_server_extra_is_kept_out_of_spark_conf(monkeypatch):
    conn(monkeypatch, "spark_x", conn_type="spark", host="yarn",
         extra={"history_server_url": "http://history.example:18080/", "spark.eventLog.enabled": "true"})
    target = HorovodRunnerHook("spark_x").resolve_target()
    assert target.history_server_url == "http://history.example:18080"
    assert target.conf == {"spark.eventLog.enabled": "true"}


@pytest.mark.parametrize("value", ["history.example:18080", "file:///tmp/x", 18080])
def test_history_server_extra_must_be_an_http_url(monkeypatch, value):
    conn(monkeypatch, "spark_x", conn_type="spark", host="yarn", extra={"history_server_url": value})
    with pytest.raises(SparkConnectionError, match="history_server_url"):
        HorovodRunnerHook("spark_x").resolve_target()


def test_no_spark_ui_link_without_an_event_log(monkeypatch, spark):
    """The shared session writes no event log: a History Server would never show it, so no link."""
    conn(monkeypatch, "spark_x", conn_type="spark", host="local[2]", extra={"history_server_url": "http://h:18080"})
    hook = HorovodRunnerHook("spark_x")
    hook.resolve_target()  # as get_conn() does
    assert spark.conf.get("spark.eventLog.enabled", "false") == "false"
    assert hook.history_server_url(spark) is None
    assert HorovodRunnerHook("spark_default").history_server_url(spark) is None  # no connection: no link
