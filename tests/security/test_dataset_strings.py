"""A ``dataset=`` string is a table name or a read-only query, refused before Spark sees it: it is a
templated field (``params``, ``dag_run.conf``), and ``spark.sql`` runs a command (CREATE, INSERT,
DROP...) at once. Finding T4-14 of issue 40."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.exceptions import DatasetError
from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator
from airflow_provider_horovod.runner.dataset import check_dataset, resolve

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
