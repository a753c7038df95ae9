"""This rank's shard of ``dataset=``: the Arrow file its barrier task spilled on this host, read
memory-mapped (``runtime.dataset()`` returns a ``Shard``).

Every rank runs the same number of steps per epoch, so collectives never wait on a rank that ran
out of data. Shards differ by at most one row; ``remainder`` says what evens them out:

- ``"wrap"`` (the default, as PySpark's ``TorchDistributor``): every rank reads
  ``ceil(total / np)`` rows per epoch; a rank one row short reads its first row again.
- ``"drop"``: every rank reads ``floor(total / np)`` rows per epoch; a rank one row long skips its
  last row (with ``shuffle=True`` a different row each epoch).

``drop_last=True`` then drops the last, partial batch on every rank alike.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner.dataset import META_SHARDS, META_TOTAL_ROWS

REMAINDERS = ("wrap", "drop")


class Shard:
    """The rows of ``dataset=`` this rank trains on.

    :param path: the Arrow IPC file of this rank's barrier task.
    :param remainder: ``"wrap"`` or ``"drop"``: how every rank gets the same rows per epoch.
    """

    def __init__(self, path: str | Path, remainder: str = "wrap") -> None:
        import pyarrow as pa

        if remainder not in REMAINDERS:
            raise ValueError("remainder must be one of %s; got %r" % (", ".join(REMAINDERS), remainder))
        self.remainder = remainder
        self.path = Path(path)
        self._map = pa.memory_map(str(self.path))
        reader = pa.ipc.open_file(self._map)
        metadata = reader.schema.metadata or {}
        self.total_rows = int(metadata[META_TOTAL_ROWS])  # of the whole dataset, every shard
        self.shards = int(metadata[META_SHARDS])
        self._table = reader.read_all().replace_schema_metadata(None)  # zero-copy: buffers point into the map
        self.schema = self._table.schema
        self.num_rows = self._table.num_rows

    @property
    def rows_per_epoch(self) -> int:
        """The rows every rank reads per epoch (the same on every rank)."""
        if self.remainder == "wrap":
            return math.ceil(self.total_rows / self.shards)
        return self.total_rows // self.shards

    def steps(self, batch_size: int, drop_last: bool = False) -> int:
        """The batches per epoch, the same on every rank."""
        _check_batch_size(batch_size)
        if drop_last:
            return self.rows_per_epoch // batch_size
        return math.ceil(self.rows_per_epoch / batch_size)

    def iter_batches(self, batch_size: int, columns: Sequence[str] | None = None, shuffle: bool = False,
                     seed: int = 0, drop_last: bool = False) -> Iterator[Any]:
        """``steps(batch_size, drop_last)`` ``pyarrow.RecordBatch``es of ``batch_size`` rows (the
        last may be shorter unless ``drop_last``). In order they are slices of the mapped file;
        ``shuffle=True`` permutes this shard's rows with ``seed`` (pass the epoch for a new order)."""
        table = self._table.select(list(columns)) if columns is not None else self._table
        order = _permutation(self.num_rows, seed) if shuffle else None
        pieces = _Pieces(table)
        rows = self.rows_per_epoch
        for step in range(self.steps(batch_size, drop_last)):
            start = step * batch_size
            stop = min(start + batch_size, rows)
            if order is None and stop <= self.num_rows:
                yield pieces.rows(start, stop)
            else:
                yield _gathered(table, order, start, stop)

    def to_torch(self, batch_size: int, columns: Sequence[str] | None = None, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, dtype: Any = None) -> Iterator[dict[str, Any]]:
        """The batches of ``iter_batches`` as dicts of ``torch.Tensor`` (column name -> tensor of
        ``batch_size`` rows; an array column gives ``[batch_size, length]``). Each tensor has its
        column's own type (Arrow double -> ``torch.float64``, float -> ``float32``, bigint ->
        ``int64``, boolean -> ``bool``) unless ``dtype`` says otherwise.

        :param dtype: a ``torch.dtype`` every floating-point column is converted to (``torch.float32``
            for ``nn.Linear`` on a Parquet double column; integer and boolean columns, labels, stay), or
            a dict column name -> ``torch.dtype`` for those columns only.
        """
        import torch

        wanted = _dtypes(torch, dtype, self.schema.names if columns is None else list(columns))
        for batch in self.iter_batches(batch_size, columns, shuffle, seed, drop_last):
            tensors = {name: torch.from_numpy(_numpy(column)) for name, column in zip(batch.schema.names, batch.columns)}
            yield {name: _converted(tensor, wanted.get(name) if isinstance(dtype, dict) else dtype, isinstance(dtype, dict))
                   for name, tensor in tensors.items()}

    def to_tf(self, batch_size: int, features: str | Sequence[str] | None = None, label: str | None = None,
              shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> Any:
        """A ``tf.data.Dataset`` of the same batches (needs the ``tensorflow`` extra), with its
        cardinality set to ``steps()``, for ``model.fit``.

        :param features: one column name (its tensor is the input), a list of names (a dict of
            tensors), or ``None`` (a dict of every column but ``label``).
        :param label: a column name: the dataset yields ``(features, label)`` pairs.
        :param shuffle: a new order on every pass (``seed``, ``seed + 1``, ... one per epoch).
        """
        import tensorflow as tf

        names = _feature_names(self.schema.names, features, label)
        columns = [*names, label] if label is not None else names
        passes = iter(range(seed, seed + 2**31))

        def pairs():
            for batch in self.iter_batches(batch_size, columns, shuffle, next(passes), drop_last):
                values = {name: _numpy(batch.column(name)) for name in columns}
                x = values[features] if isinstance(features, str) else {name: values[name] for name in names}
                yield (x, values[label]) if label is not None else x

        specs = {name: _tensor_spec(tf, self.schema.field(name).type) for name in columns}
        x_spec = specs[features] if isinstance(features, str) else {name: specs[name] for name in names}
        signature = (x_spec, specs[label]) if label is not None else x_spec
        dataset = tf.data.Dataset.from_generator(pairs, output_signature=signature)
        return dataset.apply(tf.data.experimental.assert_cardinality(self.steps(batch_size, drop_last)))

    def __repr__(self) -> str:
        return "Shard(%d of %d rows in %d shards, %s, %s)" % (self.num_rows, self.total_rows, self.shards,
                                                              self.remainder, self.path)


def _dtypes(torch: Any, dtype: Any, names: Sequence[str]) -> dict[str, Any]:
    """``to_torch``'s ``dtype=`` checked: ``None``, a ``torch.dtype`` or a dict of them by column name."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return {}
    if isinstance(dtype, dict):
        unknown = sorted(set(dtype) - set(names))
        bad = [k for k, v in dtype.items() if not isinstance(v, torch.dtype)]
        if unknown or bad:
            raise ValueError("to_torch(dtype=) names %s; the columns are %s and each value is a torch.dtype." % (
                ", ".join(map(repr, unknown + bad)), ", ".join(names)))
        return dict(dtype)
    raise ValueError("to_torch(dtype=) takes a torch.dtype (e.g. torch.float32) or a dict column -> torch.dtype; "
                     "got %r." % (dtype,))


def _converted(tensor: Any, dtype: Any, named: bool) -> Any:
    """A single ``dtype`` converts floating-point columns only (labels keep their integer type); a
    column named in a dict is converted whatever its type."""
    if dtype is None or tensor.dtype == dtype or not (named or tensor.is_floating_point()):
        return tensor
    return tensor.to(dtype)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError("batch_size must be a positive int; got %r" % (batch_size,))


def _permutation(n: int, seed: int) -> Any:
    import numpy

    return numpy.random.default_rng(seed).permutation(n)


class _Pieces:
    """The shard's record batches as the file holds them (slices of the map, as Spark's Arrow
    batches arrived): rows ``start..stop`` in order are a zero-copy slice of one of them, or the
    concatenation of the slices of the few they span."""

    def __init__(self, table: Any) -> None:
        import numpy

        self.batches = table.to_batches()
        self.starts = numpy.cumsum([0] + [b.num_rows for b in self.batches]).tolist()

    def rows(self, start: int, stop: int) -> Any:
        i = bisect.bisect_right(self.starts, start) - 1
        first = self.batches[i]
        if stop <= self.starts[i + 1]:
            return first.slice(start - self.starts[i], stop - start)
        parts = [first.slice(start - self.starts[i])]
        while stop > self.starts[i + 1]:
            i += 1
            parts.append(self.batches[i].slice(0, min(stop, self.starts[i + 1]) - self.starts[i]))
        return _concat(parts)


def _concat(parts: list[Any]) -> Any:
    import pyarrow as pa

    if hasattr(pa, "concat_batches"):  # pyarrow >= 19
        return pa.concat_batches(parts)
    return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]


def _gathered(table: Any, order: Any, start: int, stop: int) -> Any:
    """Rows ``start..stop`` of an epoch gathered into one RecordBatch: through a permutation, or
    the rows a wrap-around reads again."""
    import numpy

    index = numpy.arange(start, stop) % table.num_rows
    return table.take(index if order is None else order[index]).combine_chunks().to_batches()[0]


def _numpy(column: Any) -> Any:
    """A column as a writable numpy array; a fixed-size list column as ``[rows, length]``."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
    else:
        values = column.to_numpy(zero_copy_only=False)
    return values if values.flags.writeable else values.copy()


def _feature_names(all_names: list[str], features: str | Sequence[str] | None, label: str | None) -> list[str]:
    if isinstance(features, str):
        names = [features]
    elif features is None:
        names = [name for name in all_names if name != label]
    else:
        names = list(features)
    unknown = [name for name in [*names, *([label] if label else [])] if name not in all_names]
    if unknown:
        raise ValueError("No column %s in the dataset; its columns are %s" % (", ".join(map(repr, unknown)), all_names))
    return names


def _tensor_spec(tf: Any, arrow_type: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_fixed_size_list(arrow_type):
        return tf.TensorSpec(shape=(None, arrow_type.list_size), dtype=tf.as_dtype(arrow_type.value_type.to_pandas_dtype()))
    return tf.TensorSpec(shape=(None,), dtype=tf.as_dtype(arrow_type.to_pandas_dtype()))
