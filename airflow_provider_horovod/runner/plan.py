"""The rank plan: a pure function from what the barrier tasks report to who is which rank.

Ranks are contiguous per host and rank 0 is partition 0, as Horovod requires. A "host" is one
Spark executor (tasks report their executor's address), so two executors on one machine are two
hosts to Horovod and to ``mpirun``. The local/cross layout is Horovod's own
``get_host_assignments``, so ``local_rank`` and ``cross_rank`` match what Horovod computes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.options import Launcher


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
    hnp_port: int = 0  # the port mpirun's out-of-band channel listens on (mpirun, partition 0 only)
    iface: str = ""  # the name of the interface holding ``address`` on this host (Gloo uses it)
    network: str = ""  # that interface's network in CIDR notation, e.g. ``10.0.3.0/24`` (mpirun uses it)
    missing: tuple[str, ...] = ()  # programs the launcher needs that are not on PATH here
    provider: str = ""  # this package's installed version on the executor (``environment``)
    horovod: str = ""  # the executor's Horovod build, one line (``environment.HorovodBuild.describe``)

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
        return cls(**raw)


# The fields a Slot shares with Horovod's own ``SlotInfo`` (get_host_assignments' answer, and what
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
    hnp_port: int = 0  # mpirun's out-of-band port in this slot's task (mpirun, rank 0); the orteds' HNP


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
            slots.append(Slot(**raw))
        return cls(tuple(slots))


def make_plan(facts: list[TaskFacts]) -> Plan:
    """Assign ranks to barrier tasks.

    Hosts are ordered by their lowest partition, so partition 0's host comes first; within a host,
    tasks are ordered by partition. That makes partition 0 rank 0 and every host's ranks contiguous.
    """
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments  # the driver has it (checked)

    if not facts:
        raise ValueError("no barrier tasks reported")
    by_executor: dict[str, list[TaskFacts]] = {}
    for f in sorted(facts, key=lambda f: f.partition):
        by_executor.setdefault(f.executor, []).append(f)
    names = {executor: "hvdhost%d" % i for i, executor in enumerate(by_executor)}
    hosts = [HostInfo(names[executor], len(tasks)) for executor, tasks in by_executor.items()]
    assignments = get_host_assignments(hosts, len(facts))
    ordered = [f for tasks in by_executor.values() for f in tasks]
    slots = []
    for info, f in zip(assignments, ordered):
        slots.append(
            Slot(
                **{name: getattr(info, name) for name in SLOT_INFO_FIELDS},
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
                hnp_port=f.hnp_port,
            )
        )
    return Plan(tuple(slots))


def rank_env(slot: Slot, launcher: Launcher) -> dict[str, str]:
    """The environment that tells a rank who it is, as ``horovodrun`` gives it under ``launcher``.

    ``HVDRUNNER_*`` always (``runtime`` reads them); ``HOROVOD_RANK`` & co only under Gloo: under
    mpirun, MPI itself says who is which rank, and Horovod code reads ``HOROVOD_RANK`` as "Gloo".
    """
    env = {
        names.ENV_HOSTNAME: slot.hostname,
        names.ENV_RANK: str(slot.rank),
        names.ENV_SIZE: str(slot.size),
        names.ENV_LOCAL_RANK: str(slot.local_rank),
        names.ENV_LOCAL_SIZE: str(slot.local_size),
        names.ENV_CROSS_RANK: str(slot.cross_rank),
        names.ENV_CROSS_SIZE: str(slot.cross_size),
    }
    if launcher == Launcher.GLOO:
        env.update({
            "HOROVOD_HOSTNAME": slot.hostname,
            "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        })
    env.update(gpu_env(slot))
    return env


def gpu_env(slot: Slot) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` is exactly the task's GPU addresses, when it has any."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)} if slot.gpus else {}


def gloo_env(rendezvous_addr: str, rendezvous_port: int, iface: str, timeout_s: int, token: str) -> dict[str, str]:
    """What every Gloo rank needs to find Horovod's rendezvous server. Horovod's client builds
    ``http://<ADDR>:<PORT>/<scope>/<key>``, so ``<addr>:<port>/<token>`` as ADDR puts the run's token
    first in every request's path (the server requires it, ``gloo.py``)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "%s:%d/%s" % (rendezvous_addr, rendezvous_port, token),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "NCCL_SOCKET_IFNAME": iface,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(timeout_s),
    }


def slot_summary(plan: Plan) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in plan.slots]
