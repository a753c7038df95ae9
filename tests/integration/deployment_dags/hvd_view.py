"""DAG of the Horovod view's tests: one try that trains and one that fails, both with a timeline,
and one that stalls (rank 1 asleep in its own code; ``stall_timeout=4``).

``np=-2`` runs the two ranks as processes of the task itself (real Horovod, Gloo, no Spark job), so
the view has real artifacts to show within seconds.
"""

from __future__ import annotations

import pendulum

from airflow.sdk import dag, task

FAILING_RANK = 1
FAILURE = "loss diverged at step 3 (nan)"


def steps(n: int) -> None:
    """``n`` allreduce steps over a few named tensors, as a training loop makes them."""
    import horovod.torch as hvd
    import torch

    for step in range(n):
        for name, size in (("layer1.weight", 4096), ("layer1.bias", 64), ("layer2.weight", 1024)):
            hvd.allreduce(torch.ones(size) * (hvd.rank() + step), name=name)
        print("step %d done" % step, flush=True)


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False, tags=["hvd-view-test"])
def hvd_view():
    @task.horovod(np=-2, launcher="gloo", timeline=True)
    def trained():
        import os

        import horovod.torch as hvd

        from airflow_provider_horovod import runtime

        hvd.init()
        steps(6)
        if hvd.rank() == 0:
            tmp = runtime.checkpoint_dir() / ".model.pt.tmp"
            tmp.write_bytes(os.urandom(300_000))
            os.replace(tmp, runtime.checkpoint_dir() / "model.pt")
            (runtime.checkpoint_dir() / "epoch.txt").write_text("6")
        return {"loss": 0.125}

    @task.horovod(np=-2, launcher="gloo", timeline=True)
    def fails():
        import horovod.torch as hvd

        hvd.init()
        steps(3)
        if hvd.rank() == FAILING_RANK:
            print("about to fail: the loss is nan", flush=True)
            raise FloatingPointError(FAILURE)
        steps(100)

    @task.horovod(np=-2, launcher="gloo", stall_timeout=4)
    def stalls():
        import time

        import horovod.torch as hvd

        hvd.init()
        steps(3)
        if hvd.rank() == FAILING_RANK:
            waits_for_a_lock_never_released(time)
        steps(100)

    trained()
    fails()
    stalls()


def waits_for_a_lock_never_released(time) -> None:
    time.sleep(3600)  # the user's frame the view shows for the stalled rank


hvd_view()
