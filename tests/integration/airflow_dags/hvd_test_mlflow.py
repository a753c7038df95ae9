"""Test DAG: MLflow tracking from the driver. ``tracked`` logs to the test's MLflow server
(connection ``mlflow_test``), ``unreachable`` to a port where nothing listens (``mlflow_dead``)."""

from __future__ import annotations

import pendulum

from airflow.sdk import dag, task

STEPS = 30


def train(lr: float, epochs: int, layers: list) -> dict:
    """Reports a step every 20 ms on every rank, and leaves a checkpoint on rank 0."""
    import os
    import time

    import horovod.torch as hvd

    from airflow_provider_horovod import runtime

    hvd.init()
    for step in range(1, STEPS + 1):
        runtime.report(step=step, total_steps=STEPS, loss=1.0 / step, rank_seen=float(hvd.rank()))
        time.sleep(0.02 if step < STEPS else 0.6)  # the last report travels alone
    if hvd.rank() == 0:
        tmp = runtime.checkpoint_dir() / ".model.txt.tmp"
        tmp.write_text("weights after %d steps" % STEPS)
        os.replace(tmp, runtime.checkpoint_dir() / "model.txt")
    return {"steps": STEPS}


@dag(schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False)
def hvd_test_mlflow():
    @task.horovod(np=-2, launcher="gloo", timeline=True, mlflow_conn_id="mlflow_test")
    def tracked(lr: float, epochs: int, layers: list):
        return train(lr, epochs, layers)

    @task.horovod(np=-1, launcher="gloo", mlflow_conn_id="mlflow_dead")
    def unreachable(lr: float, epochs: int, layers: list):
        return train(lr, epochs, layers)

    tracked(lr=0.1, epochs=3, layers=[64, 10])  # op_kwargs: the scalars become MLflow params
    unreachable(lr=0.1, epochs=3, layers=[64, 10])


hvd_test_mlflow()
