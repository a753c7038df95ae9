"""Training functions of the dataset= tests, run on real Horovod ranks (shipped by value)."""

from __future__ import annotations

import os
import socket


def own_address() -> str:
    """This host's first address outside loopback: hosts named alike still differ by it."""
    import psutil

    return next(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family == socket.AF_INET and not a.address.startswith("127."))


def shard_job(batch_size: int = 8, remainder: str = "wrap"):
    """Each rank's view of its shard; one allreduce per step, so unequal steps would hang the job."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    shard = runtime.dataset(remainder)
    epoch = []
    for batch in shard.iter_batches(batch_size):
        epoch += batch.column("id").to_pylist()
        hvd.allreduce(torch.tensor([float(batch.num_rows)]), name="rows")
    return hvd.allgather_object({
        "rank": hvd.rank(),
        "num_rows": shard.num_rows,
        "steps": shard.steps(batch_size),
        "epoch_ids": epoch,
        "shard_ids": epoch[: shard.num_rows],
        "file": str(shard.path),
        "task_dir": os.environ["HVDRUNNER_TASK_DIR"],
        "host": own_address(),  # not the host name: the bed's hosts share one
        "columns": shard.schema.names,
    })


def marker_job(marker: str):
    """Writes ``marker``: proof that a rank started."""
    with open(marker, "w") as f:
        f.write("started")
    return "started"


def no_dataset_job():
    from airflow_provider_horovod import runtime

    return runtime.dataset().num_rows


def linear_regression_job(epochs: int = 4, batch_size: int = 16, lr: float = 0.05):
    """Fits y = x . w on the dataset with DistributedOptimizer through ``to_torch``; returns every
    rank's weights and the mean loss of each epoch."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(hvd.rank())  # different on purpose: the broadcast makes them equal
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    shard = runtime.dataset()
    losses = []
    for epoch in range(epochs):
        total = torch.tensor(0.0)
        for batch in shard.to_torch(batch_size, columns=["x", "y"], shuffle=True, seed=epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
            loss.backward()
            optimizer.step()
            total += loss.detach()
        losses.append(hvd.allreduce(total / shard.steps(batch_size), name="epoch_loss").item())
    weights = model.weight.detach().flatten().tolist()
    return {"weights": hvd.allgather_object(weights), "losses": losses}


def keras_fit_job(epochs: int = 2, batch_size: int = 16):
    """Fits a tf-keras classifier with Horovod's DistributedOptimizer on ``to_tf``; returns every
    rank's final weights, its steps per epoch and the averaged accuracy per epoch."""
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from airflow_provider_horovod import runtime

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    tf.keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose: the broadcast makes them equal
    shard = runtime.dataset()
    data = shard.to_tf(batch_size, features="x", label="label", shuffle=True)
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1 * hvd.size(), momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(data, epochs=epochs, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
    return hvd_tf.allgather_object({
        "weights": [w.tolist() for w in model.get_weights()],
        "steps": int(data.cardinality().numpy()),
        "accuracy": history.history["accuracy"],
    })


def assert_shards_are_the_dataset(ranks: list[dict], rows: int, plan: list[dict] | None = None) -> None:
    """What every test of ``shard_job`` checks, on any cluster: the ranks' shards are disjoint, their
    union is ``range(rows)`` and their sizes differ by at most one row; each rank read a file that
    its own barrier task spilled (the plan's ``task_dir`` of its slot, when given) and the run removed."""
    shards = [r["shard_ids"] for r in ranks]
    assert sum(len(s) for s in shards) == rows and set().union(*shards) == set(range(rows))
    sizes = sorted(r["num_rows"] for r in ranks)
    assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == rows
    assert len({r["task_dir"] for r in ranks}) == len(ranks)
    for r in ranks:
        assert r["file"].startswith(r["task_dir"] + os.sep) and not os.path.exists(r["file"])
    if plan is not None:
        assert [r["task_dir"] for r in ranks] == [slot["task_dir"] for slot in plan]
