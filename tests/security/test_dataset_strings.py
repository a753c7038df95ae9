"""A ``dataset=`` string is a table name or a read-only query, refused before Spark runs it: it is a
templated field (``params``, ``dag_run.conf``), and ``spark.sql`` runs a command (CREATE, INSERT,
DROP...) at once. Finding T4-14 of issue 40; of issue 49: a backquoted function name passed the
token check and Spark ran it, so the decision is Spark's own parse of the text (``dataset_sql``)."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.exceptions import DatasetError
from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator
from airflow_provider_horovod.runner import dataset_sql
from airflow_provider_horovod.runner.dataset import check_dataset, prepare_dataset, resolve

WRITES = [
    "CREATE TABLE pwned AS SELECT 1", "INSERT INTO t SELECT 1", "DROP TABLE t", "SET spark.sql.ansi.enabled=false",
    "WITH s AS (SELECT 1) INSERT INTO t SELECT * FROM s", "FROM s INSERT INTO t SELECT a",  # a write behind a query's start
    "SELECT 1; DROP TABLE t", "SELECT java_method('java.lang.System', 'exit', 0)",
    "SELECT r'\\' , (DELETE FROM t) '",  # a raw string ends at its second quote: DELETE is outside it
    "/* a comment */ CACHE TABLE t", "MERGE INTO t USING s ON true WHEN MATCHED THEN DELETE",
]
READS = [
    "events", "db.events", "parquet.`/data/events`", "SELECT * FROM parquet.`/data/events` WHERE day <= '2026-12-04'",
    "WITH s AS (SELECT 1 AS a) SELECT a FROM s", "(SELECT 1) UNION (SELECT 2)", "SELECT 'insert; drop' AS words;",
    "SELECT /* delete */ last_update, date_add(d, 1), `update` FROM t -- merge", "FROM t SELECT a", "VALUES (1), (2)",
]


@pytest.mark.parametrize("text", WRITES)
def test_a_dataset_string_that_writes_is_refused_before_spark_sees_it(text):
    with pytest.raises(DatasetError, match="neither a table name nor a read-only query"):
        HorovodRunner(2, dataset=text)
    with pytest.raises(DatasetError, match="neither a table name nor a read-only query"):
        resolve(None, text)  # after rendering: no SparkSession is touched (there is none)


def test_table_names_and_queries_that_read_pass():
    for text in READS:
        check_dataset(text)


def test_a_templated_dataset_is_checked_once_rendered():
    op = HorovodRunnerOperator(task_id="t", training_callable="m:f", np=2, dataset="{{ params.query }}")
    assert op.dataset == "{{ params.query }}"  # checked when the engine takes the rendered text
    with pytest.raises(DatasetError, match="read-only query"):
        HorovodRunnerOperator(task_id="u", training_callable="m:f", np=2, dataset="DROP TABLE t")


# -- issue 49: decided on Spark's parse --------------------------------------------------------------
PROPERTY = "hvdrunner.pwned"
SET = "'java.lang.System', 'setProperty', '%s', 'yes'" % PROPERTY
CALLS_JAVA = [  # each a numeric column, so that on main's code the count ran it and set the property
    "SELECT length(`reflect`(%s)) AS n" % SET, "SELECT length(`java_method`(%s)) AS n" % SET,
    "SELECT length(`try_reflect`(%s)) AS n" % SET, "SELECT length(IDENTIFIER('reflect')(%s)) AS n" % SET,
    "SELECT length(builtin.`reflect`(%s)) AS n" % SET, "SELECT length(system.builtin.java_method(%s)) AS n" % SET,
    "WITH s AS (SELECT length(`reflect`(%s)) AS n) SELECT n FROM s" % SET,
    "SELECT (SELECT length(`reflect`(%s))) AS n" % SET,
    "SELECT id FROM range(2) WHERE EXISTS (SELECT `java_method`(%s))" % SET,
    "SELECT id FROM range(2) ORDER BY `reflect`(%s)" % SET, "VALUES (length(`reflect`(%s)))" % SET,
]


@pytest.mark.parametrize("text", CALLS_JAVA)
def test_a_function_that_calls_java_is_refused_under_any_name_and_never_runs(spark, text):
    """The review's variant: a templated dataset= set a system property in the driver's JVM."""
    with pytest.raises(DatasetError, match="read-only query"):
        prepare_dataset(spark, text, 1)
    with pytest.raises(DatasetError, match="Spark's parse"):  # the decision, whatever the early token check says
        dataset_sql.check_on_spark(spark, text)
    assert spark.sparkContext._jvm.System.getProperty(PROPERTY) is None


@pytest.mark.parametrize("text", WRITES + ["SELECT my_catalog.db.udf(1)", "SELECT * FROM read_files('/etc')",
                                           "EXECUTE IMMEDIATE 'DROP TABLE t'", "SELECT * FROM t LATERAL VIEW `reflect`(%s) v" % SET])
def test_spark_itself_refuses_what_the_early_token_check_refuses_and_more(spark, text):
    """The decision does not rest on tokens: what only Spark's parse says, it refuses on its own."""
    with pytest.raises(DatasetError):
        dataset_sql.check_on_spark(spark, text)


def test_queries_that_read_pass_sparks_parse(spark):
    for text in [*READS[3:], "SELECT id, abs(id) AS a FROM range(4) LATERAL VIEW explode(array(1, 2)) e AS x",
                 "SELECT /*+ REPARTITION(2) */ id, sum(id) OVER (PARTITION BY id % 2 ORDER BY id) FROM range(4)",
                 "SELECT id FROM range(4) WHERE id IN (SELECT 1) AND EXISTS (SELECT 2)"]:
        dataset_sql.check_on_spark(spark, text)  # the plan is walked; no table is looked up


@pytest.mark.parametrize("text, refused", [("SELECT `reflect`(%s)" % SET, True), ("SELECT 1; DROP TABLE t", True),
                                           ("INSERT INTO t SELECT 1", True), ("SELECT abs(id) AS a FROM range(3);", False)])
def test_a_connect_session_without_a_jvm_here_has_the_server_parse_a_subquery_and_refuses_reflection(spark, text, refused):
    """Spark Connect has no parse API: the text is the body of a subquery, which only a query can be,
    and the analysed plan must call no reflective function (the same check on a classic session)."""
    if refused:
        with pytest.raises(DatasetError):
            dataset_sql.connect_check(spark, text)
    else:
        dataset_sql.connect_check(spark, text)
    assert spark.sparkContext._jvm.System.getProperty(PROPERTY) is None
