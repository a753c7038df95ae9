"""Training functions for the warm rank processes' tests (``test_warm_ranks.py``): what a rank sees of
itself, and ranks that end by their own signal or exit code."""

from __future__ import annotations

import os
import signal
import sys
import time


def whoami_job(kind: str = "horovod") -> dict:
    """Every rank's view of its own process: its parent, command line, environment, folder, module
    path, ``__main__``, torch's thread count and whether CUDA was initialised before it began."""
    import psutil

    cuda_before = bool("torch" in sys.modules and sys.modules["torch"].cuda.is_initialized())
    import torch

    if kind == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        gather = [None] * dist.get_world_size()
        collect = lambda me: (dist.all_gather_object(gather, me), gather)[1]  # noqa: E731
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
        collect = hvd.allgather_object
    me = psutil.Process()
    seen = {
        "rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "parent": me.parent().cmdline(),
        "cmdline": me.cmdline(), "env": dict(os.environ), "cwd": os.getcwd(), "argv0": sys.argv[0],
        "path": list(sys.path), "main": sys.modules["__main__"].__spec__.name, "threads": torch.get_num_threads(),
        "cuda_before": cuda_before,
    }
    return collect(seen)


def ends_by_itself_job(how: str, kind: str = "horovod", victim: int = 1) -> None:
    """Rank ``victim`` ends itself after the first collective: ``how="signal"`` by SIGABRT, ``"exit"``
    by ``os._exit(3)``; the others wait."""
    import torch

    if kind == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.all_reduce(torch.ones(1))
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
        hvd.allreduce(torch.ones(1))
    if rank == victim:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGABRT)
        os._exit(3)
    time.sleep(120)


_KEPT: list = []  # what a rank keeps alive until its interpreter ends (a file left open by the training code)


def exit_duties_job(folder: str) -> int:
    """A rank that leaves its end work to do: a file it never closed with its last write still in the
    buffer, an ``atexit`` handler, a non-daemon thread still working. Each writes a file named after the
    rank. Returns how many objects the collector had frozen when the function began."""
    import atexit
    import gc
    import threading

    import horovod.torch as hvd

    frozen = gc.get_freeze_count()
    hvd.init()
    rank = hvd.rank()

    def write(name: str) -> None:
        with open(os.path.join(folder, "%s-%d.txt" % (name, rank)), "w") as f:
            f.write(name)

    left_open = open(os.path.join(folder, "unclosed-%d.txt" % rank), "w")  # noqa: SIM115 - the point
    left_open.write("unclosed")
    _KEPT.append(left_open)
    atexit.register(write, "atexit")
    threading.Thread(target=lambda: (time.sleep(1.0), write("thread"))).start()
    return frozen
