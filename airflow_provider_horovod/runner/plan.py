"""The rank plan: a pure function from what the barrier tasks report to who is which rank.

Ranks are contiguous per host and rank 0 is partition 0, as Horovod requires. A "host" is one
Spark executor (tasks report their executor's address), so two executors on one machine are two
hosts to Horovod, ``mpirun`` and torch. The local/cross layout is Horovod's own
``get_host_assignments`` (``host_assignments``), so ``local_rank`` and ``cross_rank`` match what Horovod computes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from airflow_provider_horovod.runner import names


@dataclasses.dataclass(frozen=True)
class TaskFacts:
    """What one barrier task reports about itself before the plan: over the driver's channel (the
    normal path), or in Spark's ``allGather`` when the executors cannot reach the driver."""

    partition: int
    executor: str  # the executor's address as Spark reports it: one per host identity
    address: str  # an IP the other tasks can reach this task on
    pid: int  # the Spark Python worker running the task; ranks watch it
    task_dir: str
    python: str
    gpus: tuple[str, ...] = ()
    service_port: int = 0  # exec service (mpirun) of this task
    rendezvous_port: int = 0  # Horovod's rendezvous server (gloo, partition 0 only)
    hnp_ports: tuple[int, ...] = ()  # the ports mpirun's out-of-band channel may listen on (mpirun, partition 0 only)
    master_port: int = 0  # torch's MASTER_PORT, held for rank 0's store (torch, partition 0 only)
    iface: str = ""  # the name of the interface holding ``address`` on this host (Gloo uses it)
    network: str = ""  # that interface's network in CIDR notation, e.g. ``10.0.3.0/24`` (mpirun uses it)
    missing: tuple[str, ...] = ()  # programs the launcher needs that are not on PATH here
    provider: str = ""  # this package's installed version on the executor (``environment``)
    horovod: str = ""  # the executor's Horovod build, one line (``environment.HorovodBuild.describe``)
    machine: str = ""  # the container's own host name, for messages only: names can repeat, executors cannot
    shm_size: int = -1  # bytes of /dev/shm on this host (``readiness``); -1: none, or not reported
    shm_free: int = -1

    @property
    def stack(self) -> dict[str, str]:
        """What ``environment.stack_differences`` compares with the driver's."""
        return {"provider": self.provider, "horovod": self.horovod}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TaskFacts:
        raw = json.loads(text)
        raw["gpus"] = tuple(raw["gpus"])
        raw["missing"] = tuple(raw["missing"])
        raw["hnp_ports"] = tuple(raw["hnp_ports"])
        return cls(**raw)


# The fields a Slot shares with Horovod's own ``SlotInfo`` (``host_assignments``' answer, and what
# its Gloo rendezvous serves): copied between the two by name.
SLOT_INFO_FIELDS = ("hostname", "rank", "local_rank", "cross_rank", "size", "local_size", "cross_size")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One rank: where it runs and what Horovod will call it (its first fields: ``SLOT_INFO_FIELDS``)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str  # host identity given to Horovod / mpirun, e.g. ``hvdhost0``
    partition: int
    executor: str
    address: str
    task_pid: int
    task_dir: str
    gpus: tuple[str, ...]
    iface: str
    network: str = ""  # CIDR of the network ``address`` is on
    service_port: int = 0  # the exec service of this slot's task (mpirun)
    rendezvous_port: int = 0  # Horovod's rendezvous server in this slot's task (Gloo, rank 0)
    hnp_ports: tuple[int, ...] = ()  # mpirun's out-of-band ports in this slot's task (mpirun, rank 0); the orteds' HNP
    master_port: int = 0  # torch's MASTER_PORT in this slot's task (torch, rank 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    slots: tuple[Slot, ...]

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def hosts(self) -> list[tuple[str, list[Slot]]]:
        """Hosts in rank order with their slots (rank 0's host first)."""
        out: dict[str, list[Slot]] = {}
        for slot in self.slots:
            out.setdefault(slot.hostname, []).append(slot)
        return list(out.items())

    @property
    def networks(self) -> list[str]:
        """The networks (CIDR) the hosts reach each other on, in rank order, each once. Interfaces
        are chosen by network, never by name: hosts name their NICs differently (``eth0``, ``ens5``)."""
        return list(dict.fromkeys(s.network for s in self.slots if s.network))

    def for_partition(self, partition: int) -> Slot:
        return next(s for s in self.slots if s.partition == partition)

    def host_leader(self, hostname: str) -> Slot:
        """The slot whose task starts the host's ``orted`` (its lowest rank)."""
        return next(s for s in self.slots if s.hostname == hostname)

    def to_json(self) -> str:
        return json.dumps([dataclasses.asdict(s) for s in self.slots])

    @classmethod
    def from_json(cls, text: str) -> Plan:
        slots = []
        for raw in json.loads(text):
            raw["gpus"] = tuple(raw["gpus"])
            raw["hnp_ports"] = tuple(raw["hnp_ports"])
            slots.append(Slot(**raw))
        return cls(tuple(slots))


LOCAL_EXECUTOR = "driver"  # the executor id of every rank of an ``np < 0`` run (the driver's own processes)


def host_identity(index: int) -> str:
    """The host name Horovod and mpirun are given for the plan's ``index``-th executor (``hvdhost0``, ...)."""
    return "hvdhost%d" % index


def make_plan(facts: list[TaskFacts]) -> Plan:
    """Assign ranks to barrier tasks.

    Hosts are ordered by their lowest partition, so partition 0's host comes first; within a host,
    tasks are ordered by partition. That makes partition 0 rank 0 and every host's ranks contiguous.
    """
    if not facts:
        raise ValueError("no barrier tasks reported")
    by_executor: dict[str, list[TaskFacts]] = {}
    for f in sorted(facts, key=lambda f: f.partition):
        by_executor.setdefault(f.executor, []).append(f)
    assignments = host_assignments([(host_identity(i), len(tasks)) for i, tasks in enumerate(by_executor.values())])
    ordered = [f for tasks in by_executor.values() for f in tasks]
    slots = []
    for info, f in zip(assignments, ordered):
        slots.append(
            Slot(
                **info,
                partition=f.partition,
                executor=f.executor,
                address=f.address,
                task_pid=f.pid,
                task_dir=f.task_dir,
                gpus=f.gpus,
                iface=f.iface,
                network=f.network,
                service_port=f.service_port,
                rendezvous_port=f.rendezvous_port,
                hnp_ports=f.hnp_ports,
                master_port=f.master_port,
            )
        )
    return Plan(tuple(slots))


def host_assignments(hosts: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Horovod's own layout (``horovod.runner.common.util.hosts.get_host_assignments``, which the
    torch launcher cannot import): ranks in host order, contiguous per host; ``cross_rank`` is the
    host's place among the hosts that have a slot of the same ``local_rank``. ``hosts``: (name, slots)."""
    out: list[dict[str, Any]] = []
    for name, count in hosts:
        for local_rank in range(count):
            peers = [other for other, slots in hosts if slots > local_rank]
            out.append({"hostname": name, "rank": len(out), "local_rank": local_rank, "cross_rank": peers.index(name),
                        "size": sum(c for _, c in hosts), "local_size": count, "cross_size": len(peers)})
    return out


def rank_env(slot: Slot) -> dict[str, str]:
    """The environment that tells a rank who it is under every launcher (``runtime`` reads it), and
    its GPUs. What a launcher itself gives a rank (``HOROVOD_RANK`` & co under Gloo, torchrun's
    ``RANK`` & co under torch; nothing under mpirun, where MPI says who is which rank) is that
    launcher's ``slot_env``."""
    env = {
        names.ENV_HOSTNAME: slot.hostname,
        names.ENV_RANK: str(slot.rank),
        names.ENV_SIZE: str(slot.size),
        names.ENV_LOCAL_RANK: str(slot.local_rank),
        names.ENV_LOCAL_SIZE: str(slot.local_size),
        names.ENV_CROSS_RANK: str(slot.cross_rank),
        names.ENV_CROSS_SIZE: str(slot.cross_size),
    }
    env.update(gpu_env(slot))
    return env


def gpu_env(slot: Slot) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` is exactly the task's GPU addresses, when it has any (and
    ``HVDRUNNER_GPUS`` says so to ``runtime.device()``: the rank's first device is ``cuda:0``)."""
    if not slot.gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus), names.ENV_GPUS: ",".join(slot.gpus)}


def slot_summary(plan: Plan) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in plan.slots]
