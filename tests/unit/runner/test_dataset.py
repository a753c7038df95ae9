"""dataset=: the barrier task's spill and the rank's shard reader, on real Arrow files (no Spark)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from airflow_provider_horovod import DatasetError, runtime
from airflow_provider_horovod.runner.dataset import DatasetSpec, check_dataset, is_table_name, offsets, spill
from airflow_provider_horovod.runner.rank.shard import Shard


def spark_batches(ids: list[int], rows_per_batch: int = 4) -> list[pa.RecordBatch]:
    """What a barrier task receives from Spark: record batches, arrays as variable lists."""
    out = []
    for start in range(0, len(ids), rows_per_batch):
        chunk = ids[start : start + rows_per_batch]
        out.append(pa.RecordBatch.from_pydict({
            "id": pa.array(chunk, pa.int64()),
            "x": pa.array([[float(i), float(i) * 2] for i in chunk], pa.list_(pa.float32())),
            "flag": pa.array([i % 2 == 0 for i in chunk]),
        }))
    return out


def shard_of(tmp_path, ids: list[int], total: int, shards: int, partition: int, remainder: str = "wrap") -> Shard:
    path = tmp_path / ("p%d.arrow" % partition)
    spill(iter(spark_batches(ids)), path, DatasetSpec(total, shards, (("x", 2),)), partition)
    return Shard(path, remainder)


def epoch_ids(shard: Shard, batch_size: int, **kwargs) -> list[list[int]]:
    return [batch.column("id").to_pylist() for batch in shard.iter_batches(batch_size, **kwargs)]


def test_partition_sizes_differ_by_at_most_one_row_and_add_up():
    spec = DatasetSpec(total_rows=11, shards=3)
    assert [spec.shard_rows(p) for p in range(3)] == [4, 4, 3]
    assert sum(DatasetSpec(1001, 7).shard_rows(p) for p in range(7)) == 1001


def test_offsets_count_the_rows_before_each_input_partition_empty_ones_included():
    counts = [{"partition": 0, "rows": 3}, {"partition": 2, "rows": 5}, {"partition": 3, "rows": 1}]
    assert offsets(counts) == [0, 3, 3, 8]


def test_spilled_shard_keeps_rows_and_makes_arrays_fixed_size_tensor_columns(tmp_path):
    shard = shard_of(tmp_path, list(range(0, 20, 2)), total=19, shards=2, partition=0)
    assert shard.num_rows == 10 and shard.total_rows == 19 and shard.shards == 2
    assert shard.schema.field("x").type == pa.list_(pa.float32(), 2)
    assert shard.schema.metadata is None  # the runner's own keys stay out of the user's schema
    assert epoch_ids(shard, 10) == [list(range(0, 20, 2))]


def test_every_rank_runs_the_same_steps_when_shards_differ_by_one_row(tmp_path):
    long = shard_of(tmp_path, list(range(0, 19, 2)), total=19, shards=2, partition=0)  # 10 rows
    short = shard_of(tmp_path, list(range(1, 19, 2)), total=19, shards=2, partition=1)  # 9 rows
    for batch_size in (1, 3, 4, 10):
        for drop_last in (False, True):
            assert long.steps(batch_size, drop_last) == short.steps(batch_size, drop_last)
            assert len(epoch_ids(short, batch_size, drop_last=drop_last)) == short.steps(batch_size, drop_last)
    assert [len(b) for b in epoch_ids(short, 4)] == [4, 4, 2]  # wrap: 10 rows on both ranks
    assert sum(epoch_ids(short, 4), [])[-1] == 1  # the short shard reads its first row again
    assert sum(epoch_ids(short, 4), [])[:9] == list(range(1, 19, 2))
    assert [len(b) for b in epoch_ids(short, 4, drop_last=True)] == [4, 4]


def test_drop_remainder_reads_the_smallest_shards_rows_on_every_rank(tmp_path):
    long = shard_of(tmp_path, list(range(0, 19, 2)), total=19, shards=2, partition=0, remainder="drop")
    assert long.rows_per_epoch == 9 and long.steps(4) == 3
    assert sum(epoch_ids(long, 4), []) == list(range(0, 18, 2))  # its 10th row is left out
    shuffled = sum(epoch_ids(long, 4, shuffle=True, seed=1), [])
    assert len(set(shuffled)) == 9 and set(shuffled) <= set(range(0, 19, 2))


def test_shuffle_is_a_permutation_that_the_seed_repeats(tmp_path):
    shard = shard_of(tmp_path, list(range(40)), total=40, shards=1, partition=0)
    first = sum(epoch_ids(shard, 7, shuffle=True, seed=3), [])
    assert sorted(first) == list(range(40)) and first != list(range(40))
    assert sum(epoch_ids(shard, 7, shuffle=True, seed=3), []) == first
    assert sum(epoch_ids(shard, 7, shuffle=True, seed=4), []) != first


def test_batches_in_order_are_slices_of_the_memory_mapped_file(tmp_path):
    shard = shard_of(tmp_path, list(range(40)), total=40, shards=1, partition=0)
    mapped = pa.total_allocated_bytes()
    batches = list(shard.iter_batches(4, columns=["id"]))  # inside the file's record batches of 4 rows
    assert pa.total_allocated_bytes() == mapped  # nothing copied into memory
    assert batches[0].schema.names == ["id"]



@pytest.mark.parametrize("batch_size", [3, 6, 10])  # inside one, across two and across three record batches of 4
def test_batches_across_the_files_record_batches_hold_the_rows_in_order(tmp_path, batch_size):
    shard = shard_of(tmp_path, list(range(0, 80, 2)), total=80, shards=2, partition=0)
    batches = list(shard.iter_batches(batch_size))
    assert [i for b in batches for i in b.column("id").to_pylist()] == list(range(0, 80, 2))
    assert all(b.num_rows == batch_size for b in batches[:-1])
    x = [row for b in batches for row in b.column("x").to_pylist()]
    assert x == [[float(i), float(i) * 2] for i in range(0, 80, 2)] and batches[-1].schema == shard.schema

def test_to_torch_gives_dicts_of_tensors_with_array_columns_as_matrices(tmp_path):
    import torch

    shard = shard_of(tmp_path, list(range(10)), total=10, shards=1, partition=0)
    batches = list(shard.to_torch(4, shuffle=True))
    assert len(batches) == 3
    first = batches[0]
    assert set(first) == {"id", "x", "flag"}
    assert first["x"].shape == (4, 2) and first["x"].dtype == torch.float32
    assert first["id"].dtype == torch.int64 and first["flag"].dtype == torch.bool
    assert torch.equal(first["x"][:, 0], first["id"].float())  # rows stay whole under shuffle


def test_a_partition_with_other_rows_than_counted_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="changed between the count and the read"):
        spill(iter(spark_batches([1, 2, 3])), tmp_path / "p.arrow", DatasetSpec(8, 2), 0)
    assert not (tmp_path / "p.arrow").exists()


def test_dataset_argument_kinds_are_checked_without_spark():
    for ok in (None, "db.events", "SELECT 1", lambda spark: spark.range(3)):
        check_dataset(ok)
    with pytest.raises(DatasetError, match="table name, a Spark SQL query, a callable"):
        check_dataset(42)
    with pytest.raises(DatasetError, match="empty string"):
        check_dataset("  ")


def test_names_are_tables_and_everything_else_is_sql():
    assert all(map(is_table_name, ["events", "db.events", "cat.db.events", "parquet.`/data/events`"]))
    assert not any(map(is_table_name, ["SELECT * FROM events", "events WHERE x", "parquet.`/a` x"]))


def test_runtime_dataset_outside_a_rank_says_it_needs_a_run_with_dataset(monkeypatch, tmp_path):
    monkeypatch.delenv("HVDRUNNER_TASK_DIR", raising=False)
    with pytest.raises(DatasetError, match="inside a rank of a run given dataset="):
        runtime.dataset()
    monkeypatch.setenv("HVDRUNNER_TASK_DIR", str(tmp_path))
    with pytest.raises(DatasetError, match="started without dataset="):
        runtime.dataset()


def test_bad_batch_size_and_remainder_name_the_allowed_values(tmp_path):
    shard = shard_of(tmp_path, list(range(4)), total=4, shards=1, partition=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        shard.steps(0)
    with pytest.raises(ValueError, match="remainder must be one of wrap, drop"):
        Shard(shard.path, "pad")


def test_to_torch_dtype_converts_floating_columns_and_keeps_labels(tmp_path):
    import torch

    shard = shard_of(tmp_path, list(range(6)), total=6, shards=1, partition=0)
    first = next(shard.to_torch(4, dtype=torch.float64))
    assert first["x"].dtype == torch.float64 and first["id"].dtype == torch.int64 and first["flag"].dtype == torch.bool
    named = next(shard.to_torch(4, dtype={"id": torch.float32}))
    assert named["id"].dtype == torch.float32 and named["x"].dtype == torch.float32
    assert named["id"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="'nope'"):
        next(shard.to_torch(4, dtype={"nope": torch.float32}))
    with pytest.raises(ValueError, match="takes a torch.dtype"):
        next(shard.to_torch(4, dtype="float32"))
