"""Training functions of the dataset= tests, run on real Horovod ranks (shipped by value)."""

from __future__ import annotations

import os


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
