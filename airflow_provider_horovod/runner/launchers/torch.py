"""``launcher="torch"``: torch.distributed's own contract, as ``torchrun`` sets it; no Horovod, no mpirun.

Every barrier task starts its one rank process with torchrun's environment (``torch/distributed/run.py``
and its ``LocalElasticAgent``; PySpark's ``TorchDistributor`` sets the same), so unmodified code runs:
``dist.init_process_group("gloo")`` (or ``"nccl"``) from the environment, ``DistributedDataParallel``,
FSDP, ``accelerate.Accelerator()``. Rank 0's ``init_process_group`` hosts torch's ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``: partition 0's address on the network the plan chose, and a port partition
0 holds bound (so nothing else takes it) until its rank is about to start. That store has no
authentication of its own (torch's, as under torchrun); it lives only while the ranks run.

``LOCAL_RANK`` indexes the devices the rank sees. A task given GPUs (``spark.task.resource.gpu.amount``)
sees exactly its own in ``CUDA_VISIBLE_DEVICES``, so, as under ``TorchDistributor``, every such task is
a torch "node" of one process: ``LOCAL_RANK`` 0, ``torch.cuda.set_device(LOCAL_RANK)`` picks its GPU.
Without GPUs the ranks of one executor share its CPUs: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` are their
place on that executor, and ``OMP_NUM_THREADS`` is 1 when several share it (unless set), as torchrun does.
"""

from __future__ import annotations

import socket

from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.task.barrier import run_rank_processes
from airflow_provider_horovod.runner.launchers import Services
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.network import LOOPBACK
from airflow_provider_horovod.runner.plan import Plan, Slot


class PortHold(Services):
    """Partition 0's hold on ``MASTER_PORT``: bound, never listening, released just before rank 0 starts."""

    def __init__(self, address: str | None) -> None:
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket()
            self._sock.bind((address, 0))
        self.port = self._sock.getsockname()[1] if self._sock is not None else 0

    def ports(self) -> dict[str, int]:
        return {"master_port": self.port} if self._sock is not None else {}

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()

    def close(self) -> None:
        self.release()


def serve(spec, partition: int, executor: str, address: str, task: TaskDir, env: dict[str, str],
          client) -> PortHold:
    return PortHold(address if partition == 0 else None)


def host_env(spec) -> dict[str, str]:
    return {}


def missing_programs(path: str) -> tuple[str, ...]:
    return ()


def slot_env(plan: Plan, slot: Slot, run_id: str, master: tuple[str, int], env: dict[str, str]) -> dict[str, str]:
    """torchrun's environment for the rank of ``slot`` (``master``: rank 0's task address and port)."""
    hosts = [name for name, _ in plan.hosts]
    if slot.gpus:  # one node per task: LOCAL_RANK indexes CUDA_VISIBLE_DEVICES, the task's own GPUs
        local_rank, local_size, group_rank, group_size = 0, 1, slot.rank, plan.size
    else:
        local_rank, local_size = slot.local_rank, slot.local_size
        group_rank, group_size = hosts.index(slot.hostname), len(hosts)
    out = {
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(slot.size),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    if slot.iface:  # the interface holding the address the plan chose: Gloo and NCCL bind their sockets there
        out.update({"GLOO_SOCKET_IFNAME": slot.iface, "NCCL_SOCKET_IFNAME": slot.iface})
    if slot.local_size > 1 and "OMP_NUM_THREADS" not in env:
        out["OMP_NUM_THREADS"] = "1"
    return out


def start(spec, plan: Plan, partition: int, task: TaskDir, env: dict[str, str], services: PortHold,
          client) -> Failure | None:
    """This task's own rank; partition 0's lets go of ``MASTER_PORT`` first, for its rank's store."""
    root = plan.slots[0]
    services.release()
    return run_rank_processes([plan.for_partition(partition)], env,
                              lambda slot: slot_env(plan, slot, spec.run_id, (root.address, root.master_port), env))


def start_local(spec, plan: Plan, task: TaskDir, env: dict[str, str]) -> Failure | None:
    hold = PortHold(LOOPBACK)
    hold.release()
    return run_rank_processes(list(plan.slots), env,
                              lambda slot: slot_env(plan, slot, spec.run_id, (LOOPBACK, hold.port), env))
