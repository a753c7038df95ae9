"""DAGs of the deployment tests: every way a user stops, reruns or times out a Horovod task.

Each training function writes a small checkpoint on rank 0 first, then does what its scenario
needs (wait to be stopped, fail, or return what it resumed from). The tests drive them through
the REST API and read what they left: XComs, logs, artifacts, processes.
"""

from __future__ import annotations

import datetime

import pendulum

from airflow.sdk import dag, task

from airflow_provider_horovod.retry import HorovodRetryPolicy

START = pendulum.datetime(2025, 1, 1, tz="UTC")
STEP_FILE = "step.txt"
# The timed-out task's execution_timeout: everything after its checkpoint is waiting for it. Its checkpoint
# came 19 s after the start on 2 cores on 6 December (next to until_marked_failed's Spark and ranks), 30-70 s
# on slower days, up to 110 s at load 15-20. A try cut off before its checkpoint leaves nothing to resume, and
# the next try, alone by then, checkpoints again (retries=2): a slow start costs one more try, not the test.
# 50 s -> 40 s (6 December: try 1 checkpointed 20-25 s after its start at load 4-6; docs/test-timing.md).
TIMEOUT_S = 40


def checkpoint_then_wait(step: int) -> None:
    """Rank 0 commits ``step`` as its checkpoint; then every rank trains "forever" until stopped."""
    import os
    import time

    import horovod.torch as hvd

    from airflow_provider_horovod import runtime

    hvd.init()
    if hvd.rank() == 0:
        tmp = runtime.checkpoint_dir() / (".%s.tmp" % STEP_FILE)
        tmp.write_text(str(step))
        os.replace(tmp, runtime.checkpoint_dir() / STEP_FILE)
        runtime.log_to_driver("checkpoint %d written" % step)
    for beat in range(100000):
        if beat % 10 == 0:
            print("training, beat %d" % beat, flush=True)
        runtime.report(step=beat, total_steps=100000, loss=1.0 / (1 + 0.1 * beat), acc=beat / (beat + 10.0))
        time.sleep(0.5)


def resumed_step() -> int | None:
    from airflow_provider_horovod import runtime

    resume = runtime.resume_dir()
    return int((resume / STEP_FILE).read_text()) if resume is not None else None


@dag(schedule=None, start_date=START, catchup=False, tags=["hvd-deployment-test"])
def hvd_deploy_stop():
    """Two tasks at once: one the test marks failed, one that runs into its execution_timeout."""

    @task.horovod(np=2, progress_interval=2)
    def until_marked_failed():
        checkpoint_then_wait(3)

    @task.horovod(np=2, execution_timeout=datetime.timedelta(seconds=TIMEOUT_S), retries=2,
                  retry_delay=datetime.timedelta(seconds=0))
    def until_timeout():
        step = resumed_step()
        if step is None:  # no earlier try left a checkpoint: checkpoint, then run into the timeout
            checkpoint_then_wait(7)
        return {"resumed_step": step}

    until_marked_failed()
    until_timeout()


@dag(schedule=None, start_date=START, catchup=False, tags=["hvd-deployment-test"],
     params={"artifact_root": "", "fail_first": True})
def hvd_deploy_crash():
    """Try 1 raises after its checkpoint; try 2 resumes, checkpoints and waits for the test to SIGKILL
    its task process; try 3 resumes from the newest committed checkpoint, the killed try 2's version;
    the test then clears the task: try 4 starts from scratch (the default resume_on_clear=False).
    With ``fail_first`` false, try 1 is the killed one and try 2 resumes from it. ``artifact_root``
    (empty: the deployment's ``[horovod] artifact_root``) is the task's own root, e.g. ``s3://...``."""

    # retry_policy=None: Airflow's own rule, which retries the function's planned exception
    @task.horovod(np=2, retries=2, retry_delay=datetime.timedelta(seconds=0), retry_policy=None,
                  artifact_root="{{ params.artifact_root }}")
    def crash(try_number: str, fail_first: str):
        import horovod.torch as hvd
        import torch

        from airflow_provider_horovod import runtime

        try_number = int(try_number)  # rendered from templates: strings
        killed_try = 2 if fail_first == "True" else 1
        if try_number < killed_try:
            hvd.init()
            if hvd.rank() == 0:
                (runtime.checkpoint_dir() / STEP_FILE).write_text("1")
            hvd.allreduce_(torch.zeros(1), name="checkpointed")
            raise RuntimeError("planned failure after checkpoint 1")
        step = resumed_step()
        if try_number == killed_try:
            checkpoint_then_wait((step or 0) + 1)  # killed with its task process: committed as a version before
        return {"resumed_step": step}

    crash(try_number="{{ ti.try_number }}", fail_first="{{ params.fail_first }}")


@dag(schedule=None, start_date=START, catchup=False, max_active_runs=2, tags=["hvd-deployment-test"])
def hvd_deploy_many():
    """Mapped over learning rates; the test triggers two runs at once. All four tasks share one Spark
    standalone cluster (the ``spark_shared`` connection of the deployment fixture)."""

    @task.horovod(np=2, launcher="gloo", spark_conn_id="spark_shared")
    def fit(lr: float, tag: str):
        import horovod.torch as hvd

        from airflow_provider_horovod import runtime

        hvd.init()
        if hvd.rank() == 0:
            (runtime.checkpoint_dir() / "owner.txt").write_text("%s lr=%s" % (tag, lr))
        return {"tag": tag, "lr": lr, "ranks": hvd.size()}

    fit.partial(tag="{{ run_id }}").expand(lr=[0.1, 0.2])


@dag(schedule=None, start_date=START, catchup=False, tags=["hvd-deployment-test"])
def hvd_deploy_restart():
    """Trains on the shared standalone cluster, committing a version every step; the test SIGKILLs the
    executor JVM of rank 1 mid-training: the same try restarts the barrier stage from the newest
    committed version (the operator's default max_restarts=2) and trains three more steps."""

    @task.horovod(np=2, launcher="gloo", spark_conn_id="spark_shared", retries=1,
                  retry_delay=datetime.timedelta(seconds=0))
    def survive():
        import os
        import time

        import horovod.torch as hvd
        import torch

        from airflow_provider_horovod import runtime

        hvd.init()
        start = resumed_step() or 0
        if hvd.rank() == 1 and runtime.attempt() == 0:  # for the test: the JVM to kill
            import psutil

            from airflow_provider_horovod.runner.names import ENV_PLAN
            from airflow_provider_horovod.runner.plan import Plan

            # its task's ancestor: a forked rank's parent is the executor's warm process, which outlives
            # the Python worker that started it
            with open(os.environ[ENV_PLAN]) as f:
                task = Plan.from_json(f.read()).slots[hvd.rank()].task_pid
            java = next(p for p in psutil.Process(task).parents() if p.name() == "java")
            runtime.log_to_driver("rank 1 runs in the executor JVM %d" % java.pid)
        for step in range(start + 1, 100000):
            hvd.allreduce_(torch.zeros(1), name="step")
            if hvd.rank() == 0:
                (runtime.checkpoint_dir() / STEP_FILE).write_text(str(step))
                runtime.commit_checkpoint(step=step)
            runtime.report(step=step, loss=1.0 / step)
            if runtime.attempt() > 0 and step >= start + 3:
                return {"resumed_step": start, "attempt": runtime.attempt(), "size": hvd.size()}
            time.sleep(0.3)

    survive()


@dag(schedule=None, start_date=START, catchup=False, tags=["hvd-deployment-test"])
def hvd_deploy_retry_policy():
    """HorovodRetryPolicy, the default: a training function that raises is not retried although
    retries=2; too few slots on a local master (which cannot grow) are not retried either, although
    retries=1, and fail without waiting start_timeout. (Too few slots on a cluster that can grow are
    retried: tests/unit/test_retry.py.)"""

    @task.horovod(np=2, retries=2)
    def raises():
        raise ValueError("the learning rate must be positive")

    @task.horovod(np=4, start_timeout=2, retries=1, retry_policy=HorovodRetryPolicy(slots_delay=0))
    def more_ranks_than_slots():  # the task's embedded local[2] Spark has 2 barrier slots, and cannot grow: not retried
        return "never runs"

    raises()
    more_ranks_than_slots()


hvd_deploy_stop()
hvd_deploy_crash()
hvd_deploy_many()
hvd_deploy_restart()
hvd_deploy_retry_policy()
