"""Train a PyTorch MLP on scikit-learn's digits with Horovod on Spark, evaluate it, publish it.

The data is a Parquet table: ``write_digits`` stores the day's rows (the digits' training split)
under ``<DIGITS_TABLE>/day=<ds>/``, and ``train`` trains on them with ``dataset=``: a templated
Spark SQL query over the folder (no catalog needed). The rows reach the ranks through the barrier
stage itself, each rank reading its own shard with ``runtime.dataset()``.

The training function is the classic Horovod recipe:

1. ``hvd.init()``;
2. read this rank's shard (``runtime.dataset().to_torch(...)``);
3. scale the learning rate by ``hvd.size()``;
4. wrap the optimizer in ``hvd.DistributedOptimizer``;
5. broadcast the initial state from rank 0;
6. checkpoint on rank 0 only, each epoch, into ``runtime.checkpoint_dir()``.

``@task.horovod`` runs it on ``np=2`` ranks in one barrier-mode Spark stage. With no
``spark_default`` connection that is an embedded ``local[2]`` Spark inside the task; define
``spark_default`` (type ``spark``, host ``spark://...``, ``yarn`` or ``k8s://...``) to use a
cluster. The timeline and the checkpoints are stored under
``[horovod] artifact_root/<dag_id>/<run_id>/<task_id>/try-<n>/``; a retry resumes from the newest
checkpoint of the earlier tries, and so does a clear in the UI, because ``train`` says
``resume_on_clear=True`` (by default a Clear starts from scratch, as Airflow means it).

The DAG runs daily by itself. ``train`` returns the training function's value (as ``@task`` does);
the try's metadata comes under its own XCom keys, so ``evaluate`` gets the stored checkpoint as
``trained["horovod_checkpoint_uri"]``. It fails below 90 % held-out accuracy. The training task
updates the ``horovod_digits_model`` Asset with the checkpoint's URI, which schedules
``horovod_digits_retrain``.

Nothing here touches Spark, Horovod or a connection when the file is parsed: heavy imports live
inside the functions.
"""

from __future__ import annotations

import os

import pendulum

from airflow.sdk import Asset, dag, task

DIGITS_MODEL = Asset("horovod_digits_model")
CHECKPOINT_FILE = "model.pt"
MIN_ACCURACY = 0.90
# The Parquet table of training rows, one folder per day (``day=YYYY-MM-DD``).
DIGITS_TABLE = os.environ.get("HOROVOD_DIGITS_TABLE") or os.path.join(
    os.environ.get("AIRFLOW_HOME", os.path.expanduser("~/airflow")), "horovod-data", "digits")
DAYS_ROWS = "SELECT pixels, label FROM parquet.`%s` WHERE day = '{{ ds }}'" % DIGITS_TABLE


def load_digits_split():
    """The digits data set (shipped with scikit-learn, nothing to download), split 75/25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    return train_test_split(features / 16.0, labels, test_size=0.25, random_state=0, stratify=labels)


def write_digits_day(table: str, day: str) -> str:
    """Store the day's training rows as ``<table>/day=<day>/digits.parquet`` (replacing a rerun's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x_train, _, y_train, _ = load_digits_split()
    rows = pa.table({
        "pixels": pa.array(x_train.astype("float32").tolist(), pa.list_(pa.float32())),
        "label": pa.array(y_train, pa.int64()),
    })
    folder = os.path.join(table, "day=%s" % day)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, ".digits.parquet.tmp")
    pq.write_table(rows, tmp)
    os.replace(tmp, os.path.join(folder, "digits.parquet"))
    return folder


def build_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train_digits(epochs: int = 8, batch_size: int = 32, base_lr: float = 0.05) -> dict:
    """Runs on every Horovod rank; returns rank 0's summary."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    torch.set_num_threads(1)  # one rank per Spark task slot: do not oversubscribe the cores
    hvd.init()
    torch.manual_seed(0)

    shard = runtime.dataset()  # this rank's rows of dataset=, on this host
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.9)
    first_epoch = 0
    resume = runtime.resume_dir()  # set on a retry, or when resuming from a given checkpoint
    if resume is not None and (resume / CHECKPOINT_FILE).exists():
        state = torch.load(resume / CHECKPOINT_FILE, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"]
        runtime.log_to_driver("rank %d resumes after epoch %d" % (hvd.rank(), first_epoch))

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    loss_fn = torch.nn.CrossEntropyLoss()
    loss = torch.tensor(0.0)
    steps_per_epoch = shard.steps(batch_size)
    step, total_steps = first_epoch * steps_per_epoch, (first_epoch + epochs) * steps_per_epoch
    for epoch in range(first_epoch + 1, first_epoch + epochs + 1):
        for batch in shard.to_torch(batch_size, shuffle=True, seed=epoch):  # the same steps on every rank
            optimizer.zero_grad()
            logits = model(batch["pixels"])
            loss = loss_fn(logits, batch["label"])
            loss.backward()
            optimizer.step()
            step += 1
            # every step, on every rank: rank 0's values reach the task log, the Horovod view and metrics.jsonl
            runtime.report(step=step, total_steps=total_steps, loss=loss.item(),
                           acc=(logits.argmax(dim=1) == batch["label"]).float().mean().item())
        loss = hvd.allreduce(loss.detach(), name="epoch_loss")  # the mean over ranks
        if hvd.rank() == 0:
            save_checkpoint(model, optimizer, epoch, runtime.checkpoint_dir())
            runtime.log_to_driver("epoch %d: loss %.4f" % (epoch, loss.item()))
    return {"epochs": first_epoch + epochs, "loss": round(loss.item(), 4), "ranks": hvd.size()}


def save_checkpoint(model, optimizer, epoch: int, folder) -> None:
    """Write under a temporary name, then rename: a half-written file is never taken as complete."""
    import torch

    tmp = folder / (".%s.tmp" % CHECKPOINT_FILE)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, tmp)
    os.replace(tmp, folder / CHECKPOINT_FILE)


def held_out_accuracy(checkpoint_uri: str) -> float:
    """Load ``model.pt`` from a stored checkpoint folder (any ObjectStoragePath URI) and score it."""
    import io

    import torch

    from airflow.sdk import ObjectStoragePath

    with (ObjectStoragePath(checkpoint_uri) / CHECKPOINT_FILE).open("rb") as stored:
        state = torch.load(io.BytesIO(stored.read()), weights_only=True)
    model = build_model()
    model.load_state_dict(state["model"])
    _, x_test, _, y_test = load_digits_split()
    with torch.no_grad():
        predicted = model(torch.tensor(x_test, dtype=torch.float32)).argmax(dim=1)
    return float((predicted == torch.tensor(y_test)).float().mean())


@dag(
    schedule="@daily",
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    tags=["example", "horovod"],
    default_args={"retries": 1},
)
def horovod_digits_train():
    @task
    def write_digits(ds=None) -> str:
        return write_digits_day(DIGITS_TABLE, ds)

    @task.horovod(np=2, launcher="mpirun", timeline=True, outlets=[DIGITS_MODEL], dataset=DAYS_ROWS,
                  resume_on_clear=True)  # a clear in the UI trains on from the newest checkpoint
    def train(epochs: int):
        return train_digits(epochs=epochs)

    @task
    def evaluate(summary: dict, checkpoint_uri: str) -> dict:
        accuracy = held_out_accuracy(checkpoint_uri)
        print("Held-out accuracy %.4f after %d epochs; checkpoint %s" % (accuracy, summary["epochs"], checkpoint_uri))
        if accuracy < MIN_ACCURACY:
            raise ValueError("Held-out accuracy %.4f is below %.2f" % (accuracy, MIN_ACCURACY))
        return {"accuracy": accuracy, "checkpoint_uri": checkpoint_uri}

    trained = train(epochs=8)
    write_digits() >> trained
    evaluate(trained, trained["horovod_checkpoint_uri"])


horovod_digits_train()
