"""Training data through the barrier stage: ``dataset=`` (a table, a Spark SQL query, a callable
``spark -> DataFrame`` or a DataFrame) becomes the barrier stage's input, split into ``np``
balanced partitions; each barrier task spills its partition to a local Arrow file for its rank
(``runtime.dataset()`` reads it, see ``runner/rank/shard.py``). Nothing goes through the driver and
nothing is stored on the way, as in PySpark's ``TorchDistributor._train_on_dataframe``.

The driver's phases, each a function (``prepare_dataset`` runs them in order):

1. ``resolve``: the source becomes a DataFrame, analysed (an unknown table or a query that does
   not parse fails here); ``check_columns``: every column is one the adapters take.
2. ``count_partitions``: one aggregation gives, per input partition, its rows, every column's
   nulls and every array column's lengths: only those numbers reach the driver.
3. ``route``: a row's global position is its input partition's offset plus its position in the
   partition; row ``i`` goes to partition ``i % np`` (through a key that Spark's own hash
   partitioner sends there), so partition sizes differ by at most one row.

The barrier task (``spill``) streams its partition into the file batch by batch (constant memory)
and checks it holds the rows the count promised: a query whose result changes between the count
and the read (``rand()``, a table being written) fails with a clear error instead of training on
uneven shards.

This module imports nothing heavy at the top, so the operator can check ``dataset=`` at parse time.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import DatasetError
from airflow_provider_horovod.runner.dataset_sql import check_on_spark

# A table name: ``name``, ``db.name``, ``catalog.db.name``, parts optionally in backticks
# (``parquet.`/data/events``` reads files with no catalog). Anything else is Spark SQL.
TABLE_NAME = re.compile(r"(?:\w+|`[^`]+`)(?:\.(?:\w+|`[^`]+`))*")
# A query is read-only Spark SQL. At DAG parse time (no Spark) the text is filtered early: it starts with
# one of QUERY_STARTS and names none of QUERY_NEVER outside string literals, backquoted names and comments
# (``check_query``). The decision is Spark's own parse of it, before ``spark.sql`` runs anything (a command
# such as CREATE, INSERT or DROP runs at once): ``dataset_sql.check_on_spark`` (issue 49, T4-14).
QUERY_STARTS = ("SELECT", "WITH", "FROM", "VALUES", "TABLE")
QUERY_NEVER = ("INSERT", "UPDATE", "DELETE", "MERGE", "REFLECT", "JAVA_METHOD", "TRY_REFLECT")  # writes; Java calls
_SQL_TOKEN = re.compile(r"""[rR]'[^']*'|[rR]"[^"]*"|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|`[^`]*`|--[^\n]*|/\*.*?\*/"""
                        r"""|(?P<word>\w+)|(?P<other>\S)""", re.S)
KEY_COLUMN = "__hvdrunner_key"
META_TOTAL_ROWS = b"hvdrunner.total_rows"
META_SHARDS = b"hvdrunner.shards"
INTEGRAL = ("byte", "short", "integer", "long")
NUMERIC = (*INTEGRAL, "float", "double", "boolean")
KEY_CANDIDATES_PER_PARTITION = 64  # ids tried per partition when looking for its hash key


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What every barrier task needs to spill its partition (travels in ``RunSpec``)."""

    total_rows: int
    shards: int
    list_sizes: tuple[tuple[str, int], ...] = ()  # each array column and its one length

    def shard_rows(self, partition: int) -> int:
        """The rows partition ``partition`` holds: ``total_rows / shards``, the first ones one more."""
        return self.total_rows // self.shards + (1 if partition < self.total_rows % self.shards else 0)


def check_dataset(dataset: Any, *, templated: bool = False) -> None:
    """What can be checked without Spark (at DAG parse time): the kind of ``dataset=``, and that a
    string is a table name or a read-only query (``templated``: a string with Jinja in it is checked
    once rendered, when the engine takes it)."""
    if dataset is None or callable(dataset) or _is_dataframe(dataset):
        return
    if not isinstance(dataset, str):
        raise DatasetError("dataset must be a table name, a Spark SQL query, a callable spark -> DataFrame or a "
                           "DataFrame; got %s" % type(dataset).__name__)
    if not dataset.strip():
        raise DatasetError("dataset is an empty string: give a table name or a Spark SQL query (or leave it out).")
    if not is_table_name(dataset) and not (templated and ("{{" in dataset or "{%" in dataset)):
        check_query(dataset)


def check_query(text: str) -> None:
    """``DatasetError`` unless ``text`` is a query that reads (see ``QUERY_STARTS``, ``QUERY_NEVER``):
    checked on the text, so nothing else ever reaches ``spark.sql``."""
    words, others = [], []
    for token in _SQL_TOKEN.finditer(text):
        if token.group("word"):
            words.append(token.group("word").upper())
        elif token.group("other") and token.group("other") not in "()":
            others.append((len(words), token.group("other")))
    refused = [w for w in words if w in QUERY_NEVER]
    semicolons = [at for at, char in others if char == ";"]
    why = ("it does not start with %s" % "/".join(QUERY_STARTS) if not words or words[0] not in QUERY_STARTS else
           "it names %s" % refused[0] if refused else
           "it holds more than one statement" if semicolons[:-1] or (semicolons and semicolons[-1] != len(words)) else
           None)
    if why is not None:
        raise DatasetError(
            "dataset=%r is neither a table name nor a read-only query (%s): a string dataset= is a table name "
            "(db.table) or a query that starts with SELECT, WITH, FROM, VALUES or TABLE and writes nothing; it is "
            "refused before Spark runs it. For anything else pass a callable spark -> DataFrame."
            % (" ".join(text.split())[:200], why))


def describe(dataset: Any) -> str:
    if isinstance(dataset, str):
        text = " ".join(dataset.split())
        return ("table %s" if is_table_name(text) else "query %r") % (text[:200],)
    if _is_dataframe(dataset):
        return "a DataFrame"
    return "the DataFrame of %s" % getattr(dataset, "__qualname__", repr(dataset))


def is_table_name(text: str) -> bool:
    return TABLE_NAME.fullmatch(text.strip()) is not None


def prepare_dataset(spark: Any, dataset: Any, np: int) -> tuple[Any, DatasetSpec]:
    """The barrier stage's input (``np`` partitions) and what its tasks need, or a ``DatasetError``."""
    df = resolve(spark, dataset)
    check_columns(df, dataset)
    counts = count_partitions(df)
    spec = check_counts(df, dataset, np, counts)
    return route(spark, df, np, offsets(counts)), spec


# -- 1. resolve -------------------------------------------------------------------------------------
def resolve(spark: Any, dataset: Any) -> Any:
    """``dataset`` as an analysed DataFrame; an unknown table or a bad query fails here."""
    check_dataset(dataset)
    from pyspark.errors import AnalysisException

    try:
        if isinstance(dataset, str):
            text = dataset.strip()
            if not is_table_name(text):
                check_on_spark(spark, text)  # the decision: Spark's own parse (runner/dataset_sql.py)
            df = spark.table(text) if is_table_name(text) else spark.sql(text)
        elif _is_dataframe(dataset):
            df = dataset
        else:
            df = dataset(spark)
            if not _is_dataframe(df):
                raise DatasetError("dataset=%s returned %s, not a DataFrame: return spark.table(...), spark.sql(...) "
                                   "or spark.read...(...)." % (describe(dataset), type(df).__name__))
        df.schema  # noqa: B018 - Spark Connect analyses only when asked
    except AnalysisException as err:
        raise DatasetError(_analysis_message(dataset, err)) from None
    return df


def _analysis_message(dataset: Any, err: Exception) -> str:
    words = str(err).strip().split("\n", 1)[0][:600]
    if "TABLE_OR_VIEW_NOT_FOUND" in str(err) and isinstance(dataset, str) and is_table_name(dataset):
        return ("dataset=%r: no table or view of that name in the session's catalog (%s). Check the name "
                "(catalog.database.table), create the table first (an upstream task's df.write.saveAsTable), or "
                "read files with a query such as \"SELECT * FROM parquet.`/path/to/folder`\"." % (dataset.strip(), words))
    if type(err).__name__ == "ParseException":
        return ("dataset=%r is not a table name, so it was read as Spark SQL, and it does not parse: %s. Fix the "
                "query (this is its text after templating)." % (" ".join(dataset.split()), words))
    return "dataset=%s cannot be analysed: %s. Fix the table or column names it uses." % (describe(dataset), words)


def check_columns(df: Any, dataset: Any) -> None:
    """Every column is numeric, boolean or an array of those: what ``to_torch``/``to_tf`` take."""
    for field in df.schema.fields:
        kind = _kind(field.dataType)
        if kind in NUMERIC:
            continue
        if kind == "array" and _kind(field.dataType.elementType) in NUMERIC:
            continue
        raise DatasetError(
            "Column %r of dataset=%s is %s, which no adapter takes (to_torch and to_tf take numeric and boolean "
            "columns and arrays of them). Select only those columns, cast it (F.col(%r).cast(\"float\")), turn "
            "strings into integer ids (pyspark.ml.feature.StringIndexer) or vectors into arrays "
            "(pyspark.ml.functions.vector_to_array) in the query." % (field.name, describe(dataset),
                                                                     field.dataType.simpleString(), field.name))


def _kind(data_type: Any) -> str:
    return data_type.typeName()


# -- 2. count ---------------------------------------------------------------------------------------
def count_partitions(df: Any) -> list[dict[str, Any]]:
    """Per input partition: its rows, each column's nulls, each array column's shortest and longest
    length and rows with null elements. The query reads every column, as the training job's does, so
    both see the same partitions."""
    from pyspark.sql import functions as F

    aggs = [F.count(F.lit(1)).alias("rows")]
    for i, field in enumerate(df.schema.fields):
        col = _col(field.name)
        aggs.append(F.sum(col.isNull().cast("long")).alias("nulls_%d" % i))
        if _kind(field.dataType) == "array":
            aggs += [F.min(F.size(col)).alias("min_%d" % i), F.max(F.size(col)).alias("max_%d" % i),
                     F.sum(F.exists(col, lambda x: x.isNull()).cast("long")).alias("holes_%d" % i)]
    rows = df.groupBy(F.spark_partition_id().alias("partition")).agg(*aggs).collect()
    return sorted((row.asDict() for row in rows), key=lambda r: r["partition"])


def check_counts(df: Any, dataset: Any, np: int, counts: list[dict[str, Any]]) -> DatasetSpec:
    """The dataset's size and values allow ``np`` shards that every adapter takes."""
    total = sum(c["rows"] for c in counts)
    what = describe(dataset)
    if total == 0:
        raise DatasetError("dataset=%s has no rows: nothing to train on. Check its filter (a templated date "
                           "before any data arrived?) or the upstream task that writes it." % what)
    if total < np:
        raise DatasetError("dataset=%s has %d rows, fewer than np=%d ranks: every rank needs at least one row. "
                           "Lower np or train on more rows." % (what, total, np))
    sizes = []
    for i, field in enumerate(df.schema.fields):
        nulls = sum(c["nulls_%d" % i] or 0 for c in counts)
        if nulls:
            raise DatasetError("Column %r of dataset=%s holds %d nulls, which tensors cannot: fill them "
                               "(df.na.fill, coalesce) or drop those rows (df.dropna) in the query." % (field.name, what, nulls))
        if _kind(field.dataType) != "array":
            continue
        holes = sum(c["holes_%d" % i] or 0 for c in counts)
        lengths = {c["min_%d" % i] for c in counts if c["rows"]} | {c["max_%d" % i] for c in counts if c["rows"]}
        if holes:
            raise DatasetError("Column %r of dataset=%s has %d arrays with null elements, which tensors cannot: "
                               "fill them in the query." % (field.name, what, holes))
        if len(lengths) != 1:
            raise DatasetError("Column %r of dataset=%s holds arrays of lengths %d to %d; a tensor column needs one "
                               "length. Pad or cut them in the query (e.g. slice(col, 1, n))."
                               % (field.name, what, min(lengths), max(lengths)))
        sizes.append((field.name, lengths.pop()))
    return DatasetSpec(total_rows=total, shards=np, list_sizes=tuple(sizes))


# -- 3. route -------------------------------------------------------------------------------------
def offsets(counts: list[dict[str, Any]]) -> list[int]:
    """The rows before each input partition, indexed by partition id (empty partitions included)."""
    rows = {c["partition"]: c["rows"] for c in counts}
    out, running = [], 0
    for partition in range(max(rows) + 1):
        out.append(running)
        running += rows.get(partition, 0)
    return out


def route(spark: Any, df: Any, np: int, starts: list[int]) -> Any:
    """``df`` in ``np`` partitions: the row at global position ``i`` in partition ``i % np``.

    A row's position is its input partition's offset plus its place in that partition (what
    ``monotonically_increasing_id`` holds below bit 33); each target partition is reached through a
    key that Spark's hash partitioner sends there.
    """
    from pyspark.sql import functions as F

    partition = F.spark_partition_id()
    place = F.monotonically_increasing_id() - F.shiftleft(partition.cast("long"), 33)
    position = F.element_at(F.array(*[F.lit(s).cast("long") for s in starts]), partition + 1) + place
    keys = F.array(*[F.lit(k).cast("long") for k in partition_keys(spark, np)])
    key = F.element_at(keys, (F.pmod(position, F.lit(np)) + 1).cast("int"))
    return df.withColumn(KEY_COLUMN, key).repartition(np, KEY_COLUMN).drop(KEY_COLUMN)


def partition_keys(spark: Any, np: int) -> list[int]:
    """For each partition ``p < np`` a long that ``repartition(np, col)`` sends to ``p``: Spark's
    hash partitioner is ``pmod(hash(col), np)``, asked of Spark itself over a few ids."""
    from pyspark.sql import functions as F

    ids = spark.range(KEY_CANDIDATES_PER_PARTITION * np)
    keys: dict[int, int] = {}
    for row in ids.select("id", F.pmod(F.hash("id"), F.lit(np)).alias("p")).collect():
        keys.setdefault(row["p"], row["id"])
    return [keys[p] for p in range(np)]


# -- in the barrier task ----------------------------------------------------------------------------
def spill(batches: Iterable[Any], path: Path, spec: DatasetSpec, partition: int) -> int:
    """Stream this task's partition into an Arrow IPC file at ``path``, one batch at a time (never
    the whole partition in memory); array columns become fixed-size lists. Returns its rows; a
    ``DatasetError`` when they are not the rows the driver's count gave this partition."""
    import pyarrow as pa

    sizes = dict(spec.list_sizes)
    metadata = {META_TOTAL_ROWS: str(spec.total_rows), META_SHARDS: str(spec.shards)}
    rows, writer = 0, None
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink:
        for batch in batches:
            batch = _fixed_lists(batch, sizes)
            if writer is None:
                schema = batch.schema.with_metadata(metadata)
                writer = pa.ipc.new_file(sink, schema)
            writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))
            rows += batch.num_rows
        if writer is not None:
            writer.close()
    expected = spec.shard_rows(partition)
    if rows != expected:
        raise DatasetError(
            "The barrier task of partition %d received %d rows of the dataset, but counting it gave that partition "
            "%d: the dataset's result changed between the count and the read. Make it deterministic (no rand(), "
            "no table being written meanwhile): e.g. write it to a table in an upstream task and train on that."
            % (partition, rows, expected))
    os.replace(tmp, path)
    return rows


def _fixed_lists(batch: Any, sizes: dict[str, int]) -> Any:
    """Spark's arrays arrive as variable lists; the driver checked each column has one length."""
    if not sizes:
        return batch
    import pyarrow as pa

    columns = [pa.FixedSizeListArray.from_arrays(column.flatten(), sizes[name]) if name in sizes else column
               for name, column in zip(batch.schema.names, batch.columns)]
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _col(name: str) -> Any:
    from pyspark.sql import functions as F

    return F.col("`%s`" % name.replace("`", "``"))


def _is_dataframe(value: Any) -> bool:
    return any(c.__name__ == "DataFrame" and c.__module__.startswith("pyspark.sql") for c in type(value).__mro__)
