"""dataset=: Spark data reaches the ranks through the barrier stage (real local[2] Spark, real Horovod)."""

from __future__ import annotations

import os

import pytest

from airflow_provider_horovod import DatasetError, HorovodRunError, HorovodRunner
from tests.integration import dataset_jobs
from tests.integration.test_tensorflow import _horovod_has_tensorflow

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

ROWS = 101  # odd: the two shards differ by one row


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_each_rank_reads_its_own_disjoint_shard_and_the_shards_are_the_dataset(spark, launcher):
    dataset = spark.range(ROWS, numPartitions=3)  # three input partitions of 33, 34 and 34 rows
    ranks = HorovodRunner(2, launcher=launcher, spark=spark, dataset=dataset).run(dataset_jobs.shard_job, batch_size=8)
    shards = [set(r["shard_ids"]) for r in ranks]
    assert len(shards[0]) + len(shards[1]) == ROWS and shards[0] | shards[1] == set(range(ROWS))
    assert sorted(r["num_rows"] for r in ranks) == [50, 51]
    assert [r["steps"] for r in ranks] == [7, 7]  # ceil(51 / 8) on both, the short shard wraps around
    assert [len(r["epoch_ids"]) for r in ranks] == [51, 51]
    assert [r["columns"] for r in ranks] == [["id"], ["id"]]
    # each rank read the file its own barrier task spilled, and the run removed it
    assert len({r["task_dir"] for r in ranks}) == 2
    assert all(r["file"].startswith(r["task_dir"] + os.sep) and not os.path.exists(r["file"]) for r in ranks)


@pytest.mark.parametrize(("remainder", "steps", "rows"), [("wrap", 6, 51), ("drop", 5, 50)])
def test_uneven_shards_run_the_same_steps_on_every_rank(spark, remainder, steps, rows):
    ranks = HorovodRunner(2, launcher="gloo", spark=spark, dataset=spark.range(ROWS, numPartitions=2)).run(
        dataset_jobs.shard_job, batch_size=10, remainder=remainder)
    assert [r["steps"] for r in ranks] == [steps, steps]
    assert [len(r["epoch_ids"]) for r in ranks] == [rows, rows]


BAD_DATASETS = {
    "unknown table": ("hvd_no_such_table", "no table or view of that name"),
    "unparsable query": ("SELECT id FROM range(4) WHERE id >", "does not parse"),
    "empty": ("SELECT id FROM range(10) WHERE id > 100", "has no rows"),
    "fewer rows than np": (lambda spark: spark.range(1), "has 1 rows, fewer than np=2"),
    "string column": ("SELECT id, CAST(id AS STRING) AS name FROM range(4)", "Column 'name' .* is string"),
    "nulls": ("SELECT IF(id = 1, NULL, id) AS v FROM range(4)", "Column 'v' .* holds 1 nulls"),
    "arrays of different lengths": ("SELECT sequence(0, id) AS v FROM range(4)", "arrays of lengths 1 to 4"),
}


@pytest.mark.parametrize("case", BAD_DATASETS)
def test_bad_dataset_fails_on_the_driver_before_any_rank_starts(spark, tmp_path, case):
    dataset, message = BAD_DATASETS[case]
    marker = tmp_path / "rank-started"
    runner = HorovodRunner(2, launcher="gloo", spark=spark, dataset=dataset)
    with pytest.raises(DatasetError, match=message):
        runner.run(dataset_jobs.marker_job, marker=str(marker))
    assert not marker.exists()
    assert runner.last_run.status == "failed" and runner.last_run.phases == {}  # no barrier stage began


def test_runtime_dataset_in_a_run_without_dataset_fails_the_rank_with_the_fix(spark):
    with pytest.raises(HorovodRunError, match="started without dataset="):
        HorovodRunner(2, launcher="gloo", spark=spark).run(dataset_jobs.no_dataset_job)


def test_to_torch_feeds_distributed_optimizer_training_that_fits_and_keeps_ranks_in_sync(spark):
    from pyspark.sql import functions as F

    x = [F.sin(F.col("id") * (i + 1)).cast("float") for i in range(4)]
    y = (x[0] - 2 * x[1] + 0.5 * x[2] + 3 * x[3]).cast("float")
    dataset = spark.range(203, numPartitions=3).select(F.array(*x).alias("x"), y.alias("y"), "id")
    result = HorovodRunner(2, launcher="mpirun", spark=spark, dataset=dataset).run(dataset_jobs.linear_regression_job)
    assert result["weights"][0] == result["weights"][1]  # averaged gradients: identical weights
    assert result["losses"][-1] < result["losses"][0] / 4
    assert result["weights"][0] == pytest.approx([1.0, -2.0, 0.5, 3.0], abs=0.5)


@pytest.mark.skipif(not _horovod_has_tensorflow(), reason="needs the tensorflow extra: scripts/setup --with tensorflow")
def test_to_tf_feeds_a_keras_fit_that_learns_and_keeps_ranks_in_sync(spark):
    from pyspark.sql import functions as F

    x = [F.sin(F.col("id") * (i + 1)).cast("float") for i in range(4)]
    label = (x[0] + x[1] > 0).cast("long")
    dataset = spark.range(301, numPartitions=2).select(F.array(*x).alias("x"), label.alias("label"))
    ranks = HorovodRunner(2, launcher="gloo", spark=spark, dataset=dataset).run(dataset_jobs.keras_fit_job, epochs=3)
    assert [r["steps"] for r in ranks] == [10, 10]  # ceil(151 / 16) on both ranks
    for mine, other in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert mine == other  # broadcast + averaged gradients
    assert ranks[0]["accuracy"][-1] > 0.8
