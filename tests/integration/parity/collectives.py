"""Horovod collectives, run with pytest *inside every rank* (see run_in_rank.py).

Not collected by the outer test suite (the file name does not start with ``test_``). Each test
asserts the exact values its own rank must see, for any number of ranks (CI uses two). Every
collective is given an explicit name: ``hvd.join()`` makes ranks issue different numbers of
collectives, so automatically numbered names would no longer match across ranks afterwards.

Horovod is initialised once, at import, and never shut down between tests. Process sets are
dynamic (``hvd.init(process_sets="dynamic")`` sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the
rank itself, the same under every launcher); static process sets would need the world size
before ``hvd.init()``, which only launcher-specific environment variables tell.
"""

from __future__ import annotations

import math
import os
import time

import horovod.torch as hvd
import pytest
import torch

hvd.init(process_sets="dynamic")

RANK = hvd.rank()
SIZE = hvd.size()
RANKS = range(SIZE)

needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least two ranks")


def mine() -> torch.Tensor:
    """This rank's contribution to the reductions: ``[r + 1, r + 2]`` in float64."""
    return torch.tensor([RANK + 1.0, RANK + 2.0], dtype=torch.float64)


def everyone(column: int) -> list[float]:
    return [r + 1.0 + column for r in RANKS]


# --- the launch ------------------------------------------------------------------------------

def test_rank_environment_is_what_horovodrun_sets_for_the_controller():
    """horovodrun sets HOROVOD_RANK & co only for Gloo; under MPI, MPI alone names the ranks.

    Code in the Horovod ecosystem reads "HOROVOD_RANK is set" as "launched with Gloo".
    """
    contract = {
        "HOROVOD_RANK": str(hvd.rank()),
        "HOROVOD_SIZE": str(hvd.size()),
        "HOROVOD_LOCAL_RANK": str(hvd.local_rank()),
        "HOROVOD_LOCAL_SIZE": str(hvd.local_size()),
        "HOROVOD_CROSS_RANK": str(hvd.cross_rank()),
        "HOROVOD_CROSS_SIZE": str(hvd.cross_size()),
    }
    seen = {name: os.environ.get(name) for name in contract}
    assert hvd.gloo_enabled() != hvd.mpi_enabled()
    if hvd.gloo_enabled():
        assert seen == contract, "under Gloo, HOROVOD_RANK & co must name this rank"
    else:
        assert seen == dict.fromkeys(contract), "under MPI, horovodrun sets none of HOROVOD_RANK & co"
        assert os.environ.get("OMPI_COMM_WORLD_RANK") == str(hvd.rank())


# --- allreduce -------------------------------------------------------------------------------

REDUCTIONS = {
    "Sum": sum,
    "Average": lambda values: sum(values) / SIZE,
    "Min": min,
    "Max": max,
    "Product": math.prod,
}


@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_allreduce_op(op):
    result = hvd.allreduce(mine(), op=getattr(hvd, op), name="allreduce.%s" % op)
    assert result.dtype == torch.float64
    assert result.tolist() == [REDUCTIONS[op](everyone(0)), REDUCTIONS[op](everyone(1))]


def test_allreduce_in_place_sums_into_the_tensor():
    tensor = mine()
    hvd.allreduce_(tensor, op=hvd.Sum, name="allreduce_.sum")
    assert tensor.tolist() == [sum(everyone(0)), sum(everyone(1))]


def test_grouped_allreduce_reduces_every_tensor_of_the_group():
    group = [torch.full((3,), float(RANK)), torch.full((2, 2), RANK + 10.0), torch.tensor([RANK], dtype=torch.int32)]
    results = hvd.grouped_allreduce(group, op=hvd.Sum, name="grouped_allreduce.sum")
    total = sum(RANKS)
    assert [r.tolist() for r in results] == [
        [float(total)] * 3,
        [[total + 10.0 * SIZE] * 2] * 2,
        [total],
    ]
    assert results[2].dtype == torch.int32


# --- allgather -------------------------------------------------------------------------------

def test_allgather_concatenates_uneven_first_dimensions_in_rank_order():
    tensor = torch.full((RANK + 1, 2), float(RANK))
    gathered = hvd.allgather(tensor, name="allgather.uneven")
    assert gathered.shape == (sum(r + 1 for r in RANKS), 2)
    assert gathered.tolist() == [[float(r), float(r)] for r in RANKS for _ in range(r + 1)]


def test_allgather_object_returns_every_ranks_object():
    assert hvd.allgather_object({"rank": RANK, "tag": "r%d" % RANK}, name="allgather_object") == [
        {"rank": r, "tag": "r%d" % r} for r in RANKS
    ]


# --- broadcast -------------------------------------------------------------------------------

def test_broadcast_takes_the_last_ranks_tensor():
    root = SIZE - 1
    result = hvd.broadcast(torch.full((2, 3), float(RANK)), root_rank=root, name="broadcast.last")
    assert result.tolist() == [[float(root)] * 3] * 2


def test_broadcast_parameters_makes_every_rank_hold_rank_zeros_weights():
    torch.manual_seed(100 + RANK)  # different on purpose
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(100)
    reference = torch.nn.Linear(3, 2)
    assert [p.tolist() for p in model.parameters()] == [p.tolist() for p in reference.parameters()]


def test_broadcast_object_sends_a_python_object_from_the_root():
    obj = {"from": RANK, "nested": [RANK, ("t", RANK)], "text": "rank %d" % RANK}
    assert hvd.broadcast_object(obj, root_rank=0, name="broadcast_object") == {
        "from": 0, "nested": [0, ("t", 0)], "text": "rank 0"}


# --- alltoall and reducescatter --------------------------------------------------------------

def test_alltoall_with_explicit_splits_delivers_each_ranks_chunk():
    # Rank r sends r + 1 rows to every rank d, valued 100 * r + d.
    splits = torch.tensor([RANK + 1] * SIZE, dtype=torch.int32)
    tensor = torch.tensor([100.0 * RANK + d for d in RANKS for _ in range(RANK + 1)])
    received, received_splits = hvd.alltoall(tensor, splits=splits, name="alltoall.splits")
    assert received_splits.tolist() == [s + 1 for s in RANKS]
    assert received.tolist() == [100.0 * s + RANK for s in RANKS for _ in range(s + 1)]


def test_reducescatter_gives_each_rank_its_slice_of_the_sum():
    # Every rank holds 2 * size rows; row i of rank r is i + r. Rank r gets rows 2r and 2r + 1.
    tensor = torch.tensor([[i + RANK] for i in range(2 * SIZE)], dtype=torch.float32)
    result = hvd.reducescatter(tensor, op=hvd.Sum, name="reducescatter.sum")
    assert result.tolist() == [[SIZE * i + float(sum(RANKS))] for i in (2 * RANK, 2 * RANK + 1)]


# --- compression -----------------------------------------------------------------------------

def test_fp16_compression_allreduce_returns_float32_exact_values():
    tensor = torch.tensor([0.5 * (RANK + 1), -0.25 * RANK], dtype=torch.float32)
    result = hvd.allreduce(tensor, op=hvd.Sum, compression=hvd.Compression.fp16, name="allreduce.fp16")
    assert result.dtype == torch.float32
    assert result.tolist() == [sum(0.5 * (r + 1) for r in RANKS), sum(-0.25 * r for r in RANKS)]


def test_distributed_optimizer_with_fp16_compression_averages_gradients():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    optimizer.zero_grad()
    model(torch.full((1, 2), RANK + 1.0)).sum().backward()  # d loss / d w = [r + 1, r + 1]
    optimizer.step()
    mean_grad = sum(r + 1.0 for r in RANKS) / SIZE
    assert model.weight.tolist() == [[1.0 - 0.5 * mean_grad, 2.0 - 0.5 * mean_grad]]


# --- errors ----------------------------------------------------------------------------------

@needs_two_ranks
def test_mismatched_shapes_raise_on_every_rank_and_horovod_keeps_working():
    # Horovod's coordinator sees the shapes disagree and fails the collective on every rank.
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape \[\d\]"):
        hvd.allreduce(torch.ones(RANK + 1), op=hvd.Sum, name="error.mismatched_shapes")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="error.after").tolist() == [float(SIZE)]


# --- join and barrier ------------------------------------------------------------------------

def test_join_with_uneven_batches_counts_only_ranks_still_training():
    # Rank r trains r + 1 batches; batch i is summed over the ranks that have not joined yet.
    sums = [hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.batch.%d" % i).item() for i in range(RANK + 1)]
    last = hvd.join()
    assert sums == [float(SIZE - i) for i in range(RANK + 1)]
    assert last == SIZE - 1  # the rank with the most batches cannot join before the others
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.after").tolist() == [float(SIZE)]


def test_barrier_holds_every_rank_until_the_last_arrives():
    hvd.barrier()
    started = time.monotonic()
    if RANK == 0:
        time.sleep(0.5)
    hvd.barrier()
    waited = time.monotonic() - started
    assert waited >= 0.4


# --- process sets ----------------------------------------------------------------------------

@needs_two_ranks
def test_dynamic_process_sets_run_collectives_among_their_members_only():
    evens = hvd.add_process_set(list(range(0, SIZE, 2)))
    odds = hvd.add_process_set(list(range(1, SIZE, 2)))
    try:
        members = list(range(RANK % 2, SIZE, 2))
        own = evens if RANK % 2 == 0 else odds
        assert (own.included(), own.size(), own.rank()) == (True, len(members), members.index(RANK))
        assert (evens if own is odds else odds).included() is False
        summed = hvd.allreduce(torch.tensor([RANK + 1.0]), op=hvd.Sum, name="ps.allreduce", process_set=own)
        assert summed.tolist() == [sum(m + 1.0 for m in members)]
        gathered = hvd.allgather(torch.tensor([float(RANK)]), name="ps.allgather", process_set=own)
        assert gathered.tolist() == [float(m) for m in members]
        root = members[-1]
        got = hvd.broadcast(torch.tensor([float(RANK)]), root_rank=root, name="ps.broadcast", process_set=own)
        assert got.tolist() == [float(root)]
        hvd.barrier(process_set=own)
    finally:
        assert hvd.remove_process_set(odds) is True
        assert hvd.remove_process_set(evens) is True
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ps.after").tolist() == [float(SIZE)]


def test_everything_still_works_at_the_end():
    assert hvd.is_initialized()
    assert hvd.allgather_object(RANK, name="end") == list(RANKS)
