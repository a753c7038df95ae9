"""Fine-tune the digits model whenever ``horovod_digits_train`` publishes a new checkpoint.

Scheduled on the ``horovod_digits_model`` Asset. ``latest_checkpoint`` reads the checkpoint URI
from the asset event's extra (the event that triggered this run; when run by hand, the newest
event of the Asset). ``HorovodRunnerOperator`` downloads that checkpoint to every rank
(``resume=<uri>``): the training function finds it in ``runtime.resume_dir()`` and continues from
there with a smaller learning rate, on every row of the digits table (written by
``horovod_digits_train``'s ``write_digits``) up to this run's date: ``dataset=`` is a templated
Spark SQL query, each rank reads its shard with ``runtime.dataset()``. ``evaluate`` checks the fine-tuned model still scores at least
90 % on the held-out split.

This file is self-contained on purpose (it repeats the small model and data helpers): the
training function travels to the Spark executors by value, with the helpers it uses.
"""

from __future__ import annotations

import os

import pendulum

from airflow.sdk import Asset, dag, task

from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator

DIGITS_MODEL = Asset("horovod_digits_model")
CHECKPOINT_FILE = "model.pt"
MIN_ACCURACY = 0.90
DIGITS_TABLE = os.environ.get("HOROVOD_DIGITS_TABLE") or os.path.join(
    os.environ.get("AIRFLOW_HOME", os.path.expanduser("~/airflow")), "horovod-data", "digits")
# Asset-triggered runs have no logical date: the day the run was made for is then its run_after.
ROWS_UP_TO_THIS_RUN = ("SELECT pixels, label FROM parquet.`%s` "
                       "WHERE day <= '{{ (dag_run.logical_date or dag_run.run_after).strftime(\"%%Y-%%m-%%d\") }}'"
                       % DIGITS_TABLE)


def load_digits_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    return train_test_split(features / 16.0, labels, test_size=0.25, random_state=0, stratify=labels)


def build_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def fine_tune_digits(epochs: int = 2, batch_size: int = 32, base_lr: float = 0.01) -> dict:
    """Runs on every Horovod rank: continue training from the checkpoint in ``runtime.resume_dir()``."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    torch.set_num_threads(1)
    hvd.init()
    resume = runtime.resume_dir()
    if resume is None or not (resume / CHECKPOINT_FILE).exists():
        raise FileNotFoundError("No %s to fine-tune from in resume_dir %s" % (CHECKPOINT_FILE, resume))
    state = torch.load(resume / CHECKPOINT_FILE, weights_only=True)

    shard = runtime.dataset()
    model = build_model()
    model.load_state_dict(state["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    loss_fn = torch.nn.CrossEntropyLoss()
    loss = torch.tensor(0.0)
    first_epoch = state["epoch"]
    for epoch in range(first_epoch + 1, first_epoch + epochs + 1):
        for batch in shard.to_torch(batch_size, shuffle=True, seed=epoch):
            optimizer.zero_grad()
            loss = loss_fn(model(batch["pixels"]), batch["label"])
            loss.backward()
            optimizer.step()
        loss = hvd.allreduce(loss.detach(), name="epoch_loss")
        if hvd.rank() == 0:
            tmp = runtime.checkpoint_dir() / (".%s.tmp" % CHECKPOINT_FILE)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, runtime.checkpoint_dir() / CHECKPOINT_FILE)
            runtime.log_to_driver("fine-tune epoch %d: loss %.4f" % (epoch, loss.item()))
    return {"fine_tuned_from_epoch": first_epoch, "epochs": first_epoch + epochs, "loss": round(loss.item(), 4)}


@dag(
    schedule=[DIGITS_MODEL],
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    tags=["example", "horovod"],
)
def horovod_digits_retrain():
    @task(inlets=[DIGITS_MODEL])
    def latest_checkpoint(*, triggering_asset_events=None, inlet_events=None) -> str:
        events = list((triggering_asset_events or {}).get(DIGITS_MODEL, [])) or list(inlet_events[DIGITS_MODEL])
        if not events:
            raise ValueError("No %s event yet: run horovod_digits_train first." % DIGITS_MODEL.name)
        extra = events[-1].extra
        print("Fine-tuning from %s (published by try %s)" % (extra["checkpoint_uri"], extra.get("try_number")))
        return extra["checkpoint_uri"]

    checkpoint_uri = latest_checkpoint()
    fine_tune = HorovodRunnerOperator(
        task_id="fine_tune",
        training_callable=fine_tune_digits,
        np=2,
        op_kwargs={"epochs": 2},
        resume=checkpoint_uri,
        dataset=ROWS_UP_TO_THIS_RUN,
    )

    @task
    def evaluate(tuned: dict) -> dict:
        import io

        import torch

        from airflow.sdk import ObjectStoragePath

        with (ObjectStoragePath(tuned["checkpoint_uri"]) / CHECKPOINT_FILE).open("rb") as stored:
            state = torch.load(io.BytesIO(stored.read()), weights_only=True)
        model = build_model()
        model.load_state_dict(state["model"])
        _, x_test, _, y_test = load_digits_split()
        with torch.no_grad():
            predicted = model(torch.tensor(x_test, dtype=torch.float32)).argmax(dim=1)
        accuracy = float((predicted == torch.tensor(y_test)).float().mean())
        print("Fine-tuned held-out accuracy %.4f; artifacts in %s" % (accuracy, tuned["artifacts_uri"]))
        if accuracy < MIN_ACCURACY:
            raise ValueError("Held-out accuracy %.4f is below %.2f" % (accuracy, MIN_ACCURACY))
        return {"accuracy": accuracy, "epochs": state["epoch"]}

    evaluate(fine_tune.output)


horovod_digits_retrain()
