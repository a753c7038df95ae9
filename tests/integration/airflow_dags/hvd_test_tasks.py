"""Test DAG: HorovodRunnerOperator with a reference string and a templated np; @task.horovod with a
result that is not JSON-serializable; both under launcher="torch"; the default retry policy's decisions (too few
slots on a local master, a rank's own crash, a rank killed and retried after the task's retry_delay);
@task.horovod whose first try fails after four checkpoints; a job killed with its task; bad input; the engine's
limits set on the operator."""

from __future__ import annotations

import datetime

import pendulum

from airflow.sdk import dag, task

from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False, params={"ranks": 2})
def hvd_test_tasks():
    HorovodRunnerOperator(
        task_id="by_reference",
        training_callable="airflow_provider_horovod.runtime:size",  # an installed function: rank 0 returns the world size
        np="{{ params.ranks }}",
        launcher="gloo",
    )

    @task.horovod(np=2, launcher="gloo")
    def decorated(scale: int):
        import horovod.torch as hvd
        import torch

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        print("allreduce sum %s" % total, flush=True)
        return {frozenset({"sum"}), total * scale}  # a set: not JSON, so it is stored as an artifact

    decorated(10)

    @task.horovod(np=-1, multiple_outputs=True)  # one local process: no Spark job
    def unrolled():
        return {"loss": 0.5, "epochs": [1, 2]}

    unrolled()

    @task.horovod(np=2, launcher="torch")
    def ddp(scale: int):
        """torch.distributed code as torchrun runs it: no Horovod."""
        import torch
        import torch.distributed as dist

        from airflow_provider_horovod import runtime

        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        print("torch all_reduce sum %s" % total.item(), flush=True)
        runtime.report(step=1, total_steps=1, loss=0.25)
        if dist.get_rank() == 0:
            torch.save({"sum": total}, runtime.checkpoint_dir() / "sum.pt")
            runtime.commit_checkpoint(step=1)
        dist.destroy_process_group()
        return total.item() * scale

    ddp(10)

    HorovodRunnerOperator(
        task_id="torch_by_reference",
        training_callable="airflow_provider_horovod.runtime:size",
        np=2,
        launcher="torch",
    )

    # The default retry policy's decisions, each with retries left (retry_delay=0: a wrong retry shows at once)
    @task.horovod(np=3, retries=1, retry_delay=datetime.timedelta(seconds=0))
    def slots_on_a_local_master():
        """np=3 on the embedded local[2]: the slots cannot grow, so no retry."""
        return 3

    slots_on_a_local_master()

    @task.horovod(np=2, launcher="gloo", retries=1, retry_delay=datetime.timedelta(seconds=0), max_restarts=1)
    def crashes_by_itself():
        """Rank 1 aborts (SIGABRT, a signal of its own): a crash, neither restarted nor retried."""
        import os

        from airflow_provider_horovod import runtime

        if runtime.rank() == 1:
            os.abort()
        return "rank 0 done"

    crashes_by_itself()

    @task.horovod(np=2, launcher="gloo", retries=1, retry_delay=datetime.timedelta(seconds=2), max_restarts=0)
    def killed_then_retried(try_number: str):
        """Try 1: rank 1 is SIGKILLed (as by the OOM killer): lost, retried after the task's own retry_delay."""
        import os
        import signal

        from airflow_provider_horovod import runtime

        if try_number == "1" and runtime.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"try": int(try_number)}

    killed_then_retried("{{ ti.try_number }}")


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False)
def hvd_test_retry():
    # retry_policy=None: Airflow's own rule, which retries the training function's exception
    @task.horovod(np=2, retries=1, retry_delay=datetime.timedelta(seconds=0), retry_policy=None, keep_checkpoints=2)
    def flaky():
        import os
        import time

        import horovod.torch as hvd
        import torch

        from airflow_provider_horovod import runtime

        hvd.init()
        resume = runtime.resume_dir()
        ckpt = runtime.checkpoint_dir()
        if resume is None:  # the first try: checkpoints of steps 38-41 while it trains, then it dies
            if hvd.rank() == 0:
                for step in range(38, 42):  # each one renamed into place: one version each (seq 1-4) ...
                    (ckpt / ".step.txt").write_text(str(step))
                    os.replace(ckpt / ".step.txt", ckpt / "step.txt")
                    time.sleep(0.5)  # ... each shipped and stored before the next (a faster one would replace it)
            hvd.allreduce_(torch.zeros(1), name="barrier")
            raise RuntimeError("first try fails after its checkpoint")
        step = int((resume / "step.txt").read_text()) + 1
        if hvd.rank() == 0:
            (ckpt / "step.txt").write_text(str(step))
        return {"resumed_step": step, "rank": hvd.rank()}

    flaky()


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False)
def hvd_test_kill():
    @task.horovod(np=2)
    def forever():
        import time

        import horovod.torch as hvd

        hvd.init()
        for step in range(100000):
            print("training step %d" % step, flush=True)
            time.sleep(0.5)

    forever()


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False,
     params={"ranks": "two", "resume": "sometimes"})
def hvd_test_bad_input():
    HorovodRunnerOperator(task_id="kwargs_do_not_fit", training_callable="airflow_provider_horovod.runtime:size", np=2,
                          op_kwargs={"epochs": 3})
    HorovodRunnerOperator(task_id="resume_not_a_uri", training_callable="airflow_provider_horovod.runtime:size", np=2,
                          resume="{{ params.resume }}")
    HorovodRunnerOperator(task_id="np_not_an_int", training_callable="airflow_provider_horovod.runtime:size",
                          np="{{ params.ranks }}")
    HorovodRunnerOperator(task_id="reference_does_not_import", training_callable="no_such_pkg_hvd.train:main", np=2)
    HorovodRunnerOperator(task_id="unwritable_root", training_callable="airflow_provider_horovod.runtime:size", np=2,
                          artifact_root="/proc/hvd-cannot-write-here")


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False)
def hvd_test_limits():
    """The operator's engine limits reach the engine: rank 0 handing over more files than
    max_artifact_files fails the try."""

    @task.horovod(np=-1, max_artifact_files=1)  # one local process: no Spark job
    def too_many_files():
        from airflow_provider_horovod import runtime

        for name in ("epoch-1.pt", "epoch-2.pt"):
            (runtime.checkpoint_dir() / name).write_bytes(b"w")
        return "trained"

    too_many_files()


hvd_test_tasks()
hvd_test_retry()
hvd_test_kill()
hvd_test_bad_input()
hvd_test_limits()
