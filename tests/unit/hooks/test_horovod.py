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
    assert target.location == "sc://connect.example:15002"  # what the log shows: no token


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


@pytest.mark.parametrize(("root", "fix"), [
    ("s3:/bucket/x", "s3://bucket/x"),
    ("s3:bucket/x", "s3://bucket/x"),
    ("file:/data/horovod", "file:///data/horovod"),
    ("gs:/team-bucket", "gs://team-bucket"),
])
def test_an_artifact_root_with_a_scheme_and_one_slash_is_refused_naming_the_url_it_meant(root, fix, monkeypatch):
    """As it was, ``s3:/bucket/x`` trained into a local folder named ``s3:`` under AIRFLOW_HOME."""
    from airflow_provider_horovod.exceptions import ArtifactError

    with pytest.raises(ArtifactError) as info:
        HorovodRunnerHook.artifact_root(root)
    assert "%r is not a URL: a scheme needs two slashes (%s)" % (root, fix) in str(info.value)
    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", root)
    with pytest.raises(ArtifactError, match="is not a URL"):
        HorovodRunnerHook.artifact_root(None)  # the configured default too


def test_a_malformed_artifact_root_is_refused_when_the_dag_is_parsed():
    from airflow.sdk import DAG

    from airflow_provider_horovod.exceptions import ArtifactError
    from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

    with DAG("bad_root", schedule=None):
        with pytest.raises(ArtifactError, match=re.escape("'s3:/bucket/x' is not a URL")):
            HorovodRunnerOperator(task_id="t", training_callable="m:f", artifact_root="s3:/bucket/x")
        HorovodRunnerOperator(task_id="templated", training_callable="m:f", artifact_root="{{ params.root }}")


def test_an_artifact_root_naming_an_undefined_connection_is_refused_naming_it(monkeypatch):
    """Before, the write probe ran without credentials and failed after seconds, blamed on the endpoint or IAM."""
    from airflow_provider_horovod.exceptions import ArtifactError

    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_AWS", raising=False)
    with pytest.raises(ArtifactError) as info:
        HorovodRunnerHook.check_artifact_root("s3://no_such_aws@bucket/horovod")
    message = str(info.value)
    assert "names the Airflow connection 'no_such_aws', which is not defined here" in message
    assert "AIRFLOW_CONN_NO_SUCH_AWS" in message and "No Spark was started" in message
    conn(monkeypatch, "some_aws", conn_type="aws", login="key", password="s3cr3t")
    HorovodRunnerHook.check_artifact_root("s3://some_aws@bucket/horovod")  # defined: fine
    HorovodRunnerHook.check_artifact_root("s3://bucket/horovod")  # none named: the provider's default chain
    HorovodRunnerHook.check_artifact_root("/data/horovod")
    HorovodRunnerHook.check_artifact_root("file:///data/horovod")


def test_an_artifact_root_whose_scheme_no_file_system_serves_is_refused_naming_the_fix():
    from airflow_provider_horovod.exceptions import ArtifactError

    with pytest.raises(ArtifactError) as info:
        HorovodRunnerHook.check_artifact_root("sx3://bucket/horovod")
    assert "needs a file system for sx3://, which is not installed" in str(info.value)
    assert "Check the scheme's spelling" in str(info.value)


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


# -- Spark's failures in our words: a master that is not there, a JVM that does not start ----------
@pytest.fixture
def closed_port():
    """A port of 127.0.0.1 bound but not listening: a connection is refused, and nothing else takes it meanwhile."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def silent_port():
    """A port of 127.0.0.1 whose accept queue is full: the kernel drops further SYNs, as a firewall would."""
    import socket

    with socket.socket() as server, socket.socket() as filler:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        filler.connect(server.getsockname())  # the one connection the queue holds, never accepted
        yield server.getsockname()[1]


@pytest.fixture
def listening_port():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_masters_that_do_not_answer_are_each_named_within_the_connect_timeout(closed_port, silent_port):
    import time

    from airflow_provider_horovod.hooks.horovod import SparkTarget, check_reachable

    master = "spark://127.0.0.1:%d,127.0.0.1:%d" % (closed_port, silent_port)
    started = time.monotonic()
    with pytest.raises(SparkConnectionError) as raised:
        check_reachable(SparkTarget(conn_id="spark_x", master=master, connect_timeout=0.5))
    assert time.monotonic() - started < 3
    assert str(raised.value).startswith(
        "Cannot reach the Spark master of connection 'spark_x' (master %s) within connect_timeout=0.5 s: "
        "127.0.0.1:%d refused the connection (nothing listens on that port); 127.0.0.1:%d did not answer "
        "within 0.5 s. No Spark was started. Start the master" % (master, closed_port, silent_port))
    assert "raise the connection's extra 'connect_timeout' (seconds)" in str(raised.value)


def test_one_answering_master_of_several_is_enough_without_waiting_for_the_others(closed_port, silent_port,
                                                                                   listening_port):
    import time

    from airflow_provider_horovod.hooks.horovod import SparkTarget, check_reachable

    master = "spark://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d" % (silent_port, closed_port, listening_port)
    started = time.monotonic()
    check_reachable(SparkTarget(conn_id="spark_x", master=master, connect_timeout=20))
    assert time.monotonic() - started < 5  # the silent master's 20 s are not waited for


@pytest.mark.parametrize(("master", "remote", "kind", "addresses"), [
    ("local[2]", None, "", []),
    ("yarn", None, "", []),  # its ResourceManager is in the Hadoop configuration spark-submit reads
    ("spark://m1:7077,m2:7078", None, "spark", [("m1", 7077), ("m2", 7078)]),
    ("spark://[::1]:7077", None, "spark", [("::1", 7077)]),
    ("k8s://https://kube.example:6443", None, "k8s", [("kube.example", 6443)]),
    ("k8s://kube.example", None, "k8s", [("kube.example", 443)]),  # Spark: no scheme means https
    ("k8s://http://kube.example", None, "k8s", [("kube.example", 80)]),
    (None, "sc://connect.example:15003/;token=t", "sc", [("connect.example", 15003)]),
    (None, "sc://connect.example", "sc", [("connect.example", 15002)]),
])
def test_what_must_answer_before_a_session_depends_on_the_master(master, remote, kind, addresses):
    from airflow_provider_horovod.hooks.horovod import SparkTarget, endpoints

    assert endpoints(SparkTarget(conn_id="spark_x", master=master, remote=remote)) == (kind, addresses)


def test_a_standalone_master_url_without_a_port_is_refused_before_spark():
    from airflow_provider_horovod.hooks.horovod import SparkTarget, check_reachable

    with pytest.raises(SparkConnectionError, match=r"connection 'spark_x' \(master spark://m1\) names 'spark://m1', "
                                                   r"which has no host and port.*spark://host:7077"):
        check_reachable(SparkTarget(conn_id="spark_x", master="spark://m1"))


@pytest.mark.parametrize(("value", "seconds"), [(None, 10.0), ("2.5", 2.5), (30, 30.0)])
def test_the_connect_timeout_extra_bounds_the_wait_for_the_master(monkeypatch, value, seconds):
    conn(monkeypatch, "spark_x", conn_type="spark", host="spark://m:7077",
         extra={} if value is None else {"connect_timeout": value})
    target = HorovodRunnerHook("spark_x").resolve_target()
    assert (target.connect_timeout, target.conf) == (seconds, {})


@pytest.mark.parametrize("value", ["soon", 0, -1, True, "inf"])
def test_a_connect_timeout_that_is_not_seconds_is_refused(monkeypatch, value):
    conn(monkeypatch, "spark_x", conn_type="spark", host="spark://m:7077", extra={"connect_timeout": value})
    with pytest.raises(SparkConnectionError, match="Extra 'connect_timeout' of connection 'spark_x' must be a number "
                                                   "of seconds above 0"):
        HorovodRunnerHook("spark_x").resolve_target()


# Each case: HorovodRunnerHook(conn_id).get_conn() with these environment variables (None: unset). One fresh
# interpreter for all (a JVM may already run in this one, and a Python with Airflow and PySpark takes seconds).
GET_CONN = """
import json, os, sys, time
from pyspark import SparkContext
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
results = {}
for conn_id, env in json.loads(sys.argv[1]):
    before = dict(os.environ)
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    started = time.monotonic()
    try:
        HorovodRunnerHook(conn_id).get_conn()
        error = None
    except Exception as err:
        error = "%s: %s" % (type(err).__name__, err)
    results[conn_id] = {"error": error, "seconds": time.monotonic() - started, "jvm": SparkContext._gateway is not None}
    os.environ.clear()
    os.environ.update(before)
print(json.dumps(results))
"""
NO_YARN = {"HADOOP_CONF_DIR": None, "YARN_CONF_DIR": None, "SPARK_TESTING": None}
WRONG_JAVA = {"JAVA_HOME": "/nonexistent/jdk"}
GONE, DEFAULT_YARN, LOCAL = "spark_gone", "spark_default", "spark_local"


@pytest.fixture(scope="module")
def get_conn_errors(tmp_path_factory):
    """Real failures of a session's start, each in a Python with no JVM yet: a master nobody listens on (a bound,
    not listening port of 127.0.0.1), the default connection's yarn without HADOOP_CONF_DIR, a wrong JAVA_HOME."""
    import socket
    import subprocess
    import sys

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        master = "spark://127.0.0.1:%d" % closed.getsockname()[1]
        conns = {GONE: {"conn_type": "spark", "host": master},
                 DEFAULT_YARN: {"conn_type": "spark", "host": "yarn", "extra": {"queue": "root.default"}},
                 LOCAL: {"conn_type": "spark", "host": "local[1]"}}
        environ = {k: v for k, v in os.environ.items() if k not in NO_YARN}
        environ["AIRFLOW_HOME"] = str(tmp_path_factory.mktemp("airflow"))
        environ.update({"AIRFLOW_CONN_%s" % conn_id.upper(): json.dumps(fields) for conn_id, fields in conns.items()})
        cases = [(GONE, {}), (DEFAULT_YARN, {}), (LOCAL, WRONG_JAVA)]
        proc = subprocess.run([sys.executable, "-c", GET_CONN, json.dumps(cases)], capture_output=True, text=True,
                              timeout=120, env=environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), master=master)


def test_a_master_nobody_listens_on_fails_at_once_naming_the_connection_before_any_jvm(get_conn_errors):
    """Spark's own client would try for 3 x 20 s and end in a py4j stack."""
    got, master = get_conn_errors[GONE], get_conn_errors["master"]
    assert got["error"].startswith(
        "SparkConnectionError: Cannot reach the Spark master of connection 'spark_gone' (master %s) within "
        "connect_timeout=10 s: %s refused the connection" % (master, master[len("spark://"):]))
    assert "Start the master, or set the connection's host to the URL its web UI shows" in got["error"]
    assert got["seconds"] < 3 and not got["jvm"]


@pytest.mark.parametrize(("conn_id", "master", "printed", "fix"), [
    pytest.param(DEFAULT_YARN, "yarn", "When running with master 'yarn' either HADOOP_CONF_DIR or YARN_CONF_DIR must be set",
                 "Set HADOOP_CONF_DIR (or YARN_CONF_DIR) in the Airflow worker's environment", id="default-yarn-trap"),
    pytest.param(LOCAL, "local[1]", "/nonexistent/jdk/bin/java: No such file or directory",
                 "Spark 4 needs a Java 17 or newer runtime on the Airflow worker: point JAVA_HOME at one",
                 id="wrong-java-home"),
])
def test_a_spark_submit_that_exits_names_the_connection_its_master_and_what_it_printed(get_conn_errors, conn_id,
                                                                                       master, printed, fix):
    got = get_conn_errors[conn_id]
    assert got["error"].startswith(
        "SparkConnectionError: Spark's JVM for connection %r (master %s) exited before the SparkSession existed "
        "(PySpark's JAVA_GATEWAY_EXITED). The last lines spark-submit printed:\n" % (conn_id, master))
    said, _, advice = got["error"].partition("printed:\n")[2].rpartition("\n")
    assert printed in said and advice.startswith(fix)
    assert ("airflow connections delete spark_default" in advice) == (conn_id == DEFAULT_YARN)
    assert not got["jvm"]


def test_only_conf_a_new_jvm_would_apply_conflicts_with_the_jvm_an_earlier_task_started():
    from airflow_provider_horovod.hooks.horovod import launch_conflicts

    launched = {"spark.master": "local[2]", "spark.driver.memory": "2g", "spark.task.maxFailures": "7"}
    assert launch_conflicts({"spark.master": "local[2]", "spark.driver.memory": "2g"}, launched) == []
    assert launch_conflicts({"spark.driver.memory": "2g", "spark.dynamicAllocation.enabled": "true"}, launched) == []
    assert launch_conflicts({"spark.driver.memory": "4g"}, launched) == ["spark.driver.memory"]
    assert launch_conflicts({}, launched) == ["spark.driver.memory"]  # unset here: the JVM keeps its 2g
    assert launch_conflicts({"spark.driver.memory": "2g", "spark.jars.packages": "org:a:1",
                             "spark.driver.extraJavaOptions": "-Dx=1"}, launched) == [
        "spark.driver.extraJavaOptions", "spark.jars.packages"]
