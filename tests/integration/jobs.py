"""Training functions the integration tests run on real Horovod ranks.

This module is not installed anywhere, so the runner ships these functions by value, as it would
a function from a notebook or a DAG file.
"""

from __future__ import annotations

import os
import signal
import time


def allreduce_job(tag: str = "x"):
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    seen = hvd.allgather_object(
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "controller": "mpi" if hvd.mpi_enabled() and os.environ.get("HOROVOD_CONTROLLER") == "mpi" else "gloo",
            "pid": os.getpid(),
            "ppid": os.getppid(),
        }
    )
    print("rank %d says hello %s" % (hvd.rank(), tag), flush=True)
    return {"tag": tag, "sum": total, "ranks": seen}


def optimizer_step_job(lr: float = 0.1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different on purpose: broadcast must make them equal
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x = torch.full((8, 4), float(hvd.rank() + 1))
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    weights = [w.detach().flatten().tolist() for w in model.parameters()]
    return hvd.allgather_object(weights)


def failing_job(fail_rank: int = 1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    if hvd.rank() == fail_rank:
        raise ValueError("boom from rank %d" % hvd.rank())
    while True:  # the other ranks wait in a collective that never completes
        hvd.allreduce(torch.ones(1))


def sigkill_job(victim: int = 1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        hvd.allreduce(torch.ones(1))


def hang_after_failure_job():
    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 0:
        time.sleep(1)
        raise RuntimeError("rank 0 gives up")
    time.sleep(10**6)  # not in any collective: only the runner can end this rank


def slow_job(steps: int = 600, marker: str = ""):
    import horovod.torch as hvd
    import torch

    hvd.init()
    for step in range(steps):
        hvd.allreduce(torch.ones(1))
        if step == 2 and marker and hvd.rank() == 0:
            open(marker, "w").close()
        time.sleep(0.1)
    return steps


def log_job():
    import horovod.torch as hvd

    from airflow_provider_horovod import runtime

    hvd.init()
    print("plain print from rank %d" % hvd.rank(), flush=True)
    runtime.log_to_driver("callback from rank %d" % hvd.rank())
    return runtime.rank(), runtime.size()
