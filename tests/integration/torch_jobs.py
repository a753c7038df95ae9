"""Training functions written for ``torchrun``, unmodified: they import no Horovod and read torch's
own environment contract. The torch launcher's tests run them (shipped by value)."""

from __future__ import annotations

import os
import time

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "GLOO_SOCKET_IFNAME",
                "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def ddp_job(steps: int = 6, lr: float = 0.1, use_dataset: bool = False, pause: float = 0.0):
    """DDP on a linear model: every rank its own data (its dataset shard, or seeded noise); rank 0
    saves and commits a checkpoint each step and reports the loss; resumes after the step in
    ``resume_dir()``. Returns every rank's environment, weights and first step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_horovod import runtime

    started = time.monotonic()
    dist.init_process_group("gloo")
    init_s = time.monotonic() - started
    rank = dist.get_rank()
    print("rank %d of %d up on %s:%s" % (rank, dist.get_world_size(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
    torch.manual_seed(rank)  # different on purpose: DDP broadcasts rank 0's weights at construction
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    resume = runtime.resume_dir()
    start = 0
    if resume is not None and (resume / "model.pt").exists():
        state = torch.load(resume / "model.pt")
        model.module.load_state_dict(state["model"])
        start = state["step"] + 1
    if use_dataset:
        ids = [v for b in runtime.dataset().iter_batches(64) for v in b.column("id").to_pylist()]
        x = torch.tensor(ids, dtype=torch.float32).reshape(-1, 1).repeat(1, 4) / 100.0
    else:
        x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True)
    loss = torch.tensor(0.0)
    for step in range(start, steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        runtime.report(step=step, total_steps=steps, loss=loss.item())
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "step": step}, runtime.checkpoint_dir() / "model.pt")
            runtime.commit_checkpoint(step=step, loss=loss.item())
        time.sleep(pause)
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, {"rank": rank, "env": {k: os.environ.get(k) for k in TORCHRUN_ENV},
                                  "weights": weights, "start": start, "rows": len(x), "init_s": init_s,
                                  "horovod_env": sorted(k for k in os.environ if k.startswith("HOROVOD_")),
                                  "runtime": (runtime.rank(), runtime.size(), runtime.local_rank()),
                                  "device": runtime.device()})
    dist.destroy_process_group()
    return {"ranks": seen, "loss": loss.item()}


def accelerate_job(steps: int = 4):
    """An ``accelerate`` training loop as its docs write it: the Accelerator reads torchrun's environment."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(accelerator.process_index)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(steps):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(weights.unsqueeze(0))
    return {"processes": accelerator.num_processes, "index": accelerator.process_index,
            "distributed": str(accelerator.distributed_type), "weights": gathered.tolist(),
            "batches": len(loader)}


def failing_ddp_job(fail_rank: int = 1):
    """``fail_rank`` raises while the other ranks wait for it in an all_reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == fail_rank:
        raise ValueError("rank %d lost its data" % fail_rank)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def slow_ddp_job(steps: int = 100000, marker: str = ""):
    """An all_reduce every 0.1 s; rank 0 touches ``marker`` once training runs."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(steps):
        dist.all_reduce(torch.ones(1))
        if step == 2 and marker and dist.get_rank() == 0:
            open(marker, "w").close()
        time.sleep(0.1)
    return steps


def fsdp_job(steps: int = 3):
    """FSDP (torch's ``fully_shard``) on CPU over Gloo: parameters sharded between the ranks; the full
    state is gathered on every rank and rank 0 saves and commits it. Returns every rank's view of it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from airflow_provider_horovod import runtime

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    full = {name: shard.full_tensor() for name, shard in model.state_dict().items()}  # every rank takes part
    local = {name: shard.to_local().numel() for name, shard in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, runtime.checkpoint_dir() / "model.pt")
        runtime.commit_checkpoint(step=steps)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, {"full": {k: round(v.sum().item(), 6) for k, v in full.items()}, "local": local})
    dist.destroy_process_group()
    return seen


def horovod_job_kept_under_torch():
    """Horovod code, as it runs under launcher="gloo"/"mpirun", given to launcher="torch" unchanged."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    return hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
