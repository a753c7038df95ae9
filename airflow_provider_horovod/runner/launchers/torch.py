"""``launcher="torch"``: torch.distributed's own contract, as ``torchrun`` sets it; no Horovod, no mpirun.

Every barrier task starts its one rank process with torchrun's environment (``torch/distributed/run.py``
and its ``LocalElasticAgent``; PySpark's ``TorchDistributor`` sets the same), so unmodified code runs:
``dist.init_process_group("gloo")`` (or ``"nccl"``) from the environment, ``DistributedDataParallel``,
FSDP, ``accelerate.Accelerator()``. Rank 0 hosts torch's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``:
partition 0's address on the network the plan chose (loopback for ``np < 0``), and a port partition 0
binds on that address only and listens on from its start (``PortHold``); rank 0's store serves on
that very socket, handed to it, so no other process can take the port and no other address of the
host reaches the store. That store has no authentication of its own (torch's, as under torchrun); it
lives only while the ranks run.

``LOCAL_RANK`` indexes the devices the rank sees. A task given GPUs (``spark.task.resource.gpu.amount``)
sees exactly its own in ``CUDA_VISIBLE_DEVICES``, so, as under ``TorchDistributor``, every such task is
a torch "node" of one process: ``LOCAL_RANK`` 0, ``torch.cuda.set_device(LOCAL_RANK)`` picks its GPU.
Without GPUs the ranks of one executor share its CPUs: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` are their
place on that executor, and ``OMP_NUM_THREADS`` is 1 when several share it (unless set), as torchrun does.

The store is up before any rank needs it, as under torchrun, whose agent hosts it
(``TORCHELASTIC_USE_AGENT_STORE``): every rank runs ``before_main`` first, in which rank 0 starts
the store in its own process and the others wait until it answers. Left to ``init_process_group``,
a rank that connects before rank 0 has started the store retries a second later: init took 0.2-1.8 s
instead of a few milliseconds here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from airflow_provider_horovod.exceptions import TorchStoreError

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.launchers import Services
from airflow_provider_horovod.runner.launchers.processes import run_rank_processes
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.network import LOOPBACK
from airflow_provider_horovod.runner.plan import Plan, Slot

STORE_FD_ENV = "HVDRUNNER_STORE_FD"  # rank 0: the descriptor of the listening socket its task holds on MASTER_PORT
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # set: torch's server ignores a failed bind and becomes a client


class PortHold(Services):
    """Partition 0's ``MASTER_PORT``, for as long as the attempt runs: bound on the plan's address only
    (loopback for ``np < 0``) and listening from the moment the task starts, so no other process can
    bind it, on that address or any other (no ``SO_REUSEADDR``; a listening socket is never shared).
    Rank 0 is handed this very socket (``pass_fds``, its number in ``STORE_FD_ENV``) and its store
    serves on it: torch never binds the port itself, so it cannot bind every address, fail to bind,
    or become a client of whoever took the port (issue 49, T5-1 and T5-2). A rank that connects before
    rank 0's store serves waits in the socket's backlog."""

    def __init__(self, address: str | None) -> None:
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
            self._sock.bind((address, 0))
            self._sock.listen(socket.SOMAXCONN)
        self.port = self._sock.getsockname()[1] if self._sock is not None else 0

    def ports(self) -> dict[str, int]:
        return {"master_port": self.port} if self._sock is not None else {}

    def pass_fds(self, slot: Slot) -> tuple[int, ...]:
        """What the rank of ``slot`` inherits: rank 0, the listening socket its store serves on."""
        return (self._sock.fileno(),) if self._sock is not None and slot.rank == 0 else ()

    def store_env(self, slot: Slot) -> dict[str, str]:
        """``STORE_FD_ENV`` for rank 0 (the number of the socket it inherits)."""
        return {STORE_FD_ENV: str(self._sock.fileno())} if self._sock is not None and slot.rank == 0 else {}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def serve(spec, partition: int, executor: str, address: str, task: TaskDir, env: dict[str, str],
          client) -> PortHold:
    return PortHold(address if partition == 0 else None)


def host_env(spec) -> dict[str, str]:
    return {}


def warm_env(spec, env: dict[str, str], local_size: int) -> dict[str, str]:
    """What a rank of a host with ``local_size`` ranks gets before any import reads it (``threads_env``)."""
    return threads_env(local_size, env)


def threads_env(local_size: int, env: dict[str, str]) -> dict[str, str]:
    """One intra-op thread per rank when a host runs several, as torchrun sets it (torch reads it at import)."""
    return {"OMP_NUM_THREADS": "1"} if local_size > 1 and "OMP_NUM_THREADS" not in env else {}


def missing_programs(path: str) -> tuple[str, ...]:
    return ()


def slot_env(plan: Plan, slot: Slot, run_id: str, master: tuple[str, int], env: dict[str, str], *,
             attempt: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """torchrun's environment for the rank of ``slot`` (``master``: rank 0's task address and port).

    ``TORCHELASTIC_RESTART_COUNT`` is the attempt's number: each restart inside the try (a lost
    executor or host, ``max_restarts``) starts the whole group again, as torchrun's agent restarts its
    workers, so a script that resumes when the count is above 0 resumes here too."""
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
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        AGENT_STORE_ENV: "True",  # rank 0's before_main hosts it, as torchrun's agent would
        names.ENV_BEFORE_MAIN: "%s:before_main" % __name__,
    }
    if slot.iface:  # the interface holding the address the plan chose: Gloo and NCCL bind their sockets there
        out.update({"GLOO_SOCKET_IFNAME": slot.iface, "NCCL_SOCKET_IFNAME": slot.iface})
    out.update(threads_env(slot.local_size, env))
    return out


def start(spec, plan: Plan, partition: int, task: TaskDir, env: dict[str, str], services: PortHold,
          client) -> Failure | None:
    """This task's own rank; partition 0's rank hosts the store on the socket ``services`` listens on."""
    root = plan.slots[0]
    return run_rank_processes([plan.for_partition(partition)], env,
                              lambda slot: {**slot_env(plan, slot, spec.run_id, (root.address, root.master_port), env,
                                                         attempt=spec.attempt, max_restarts=spec.max_restarts),
                                            **services.store_env(slot)},
                              pass_fds=services.pass_fds)


def start_local(spec, plan: Plan, task: TaskDir, env: dict[str, str]) -> Failure | None:
    """``np < 0``: every rank on the driver; the store on loopback only, as every other endpoint of such a run."""
    hold = PortHold(LOOPBACK)
    try:
        return run_rank_processes(list(plan.slots), env,
                                  lambda slot: {**slot_env(plan, slot, spec.run_id, (LOOPBACK, hold.port), env,
                                                             attempt=spec.attempt, max_restarts=spec.max_restarts),
                                                **hold.store_env(slot)},
                                  pass_fds=hold.pass_fds)
    finally:
        hold.close()


# -- in the rank process ------------------------------------------------------------------------------
STORE_WAIT_S = 600.0  # how long a rank waits for rank 0's store: rank 0 imports torch first, on a busy host too
READY_WAIT_S = 60.0  # how long rank 0, done, keeps its store for ranks that have not reached it yet
READY_KEY = "hvdrunner/ready"  # each rank but 0 adds 1 once it has reached the store
_store: Any = None  # rank 0's store: it lives as long as the rank process


def before_main() -> None:
    """Every rank, before the training function: torch.distributed imported; rank 0 starts the
    store on the socket its task listens on at ``MASTER_ADDR:MASTER_PORT``, the other ranks wait
    until it answers, so that no ``init_process_group`` connects too early and retries a second
    later. Each of them then says so in the store, and rank 0, done before them (a function that
    never calls ``init_process_group``), keeps the store until they all have: else a late rank
    waits for a store that is gone."""
    global _store
    import atexit

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ["RANK"] == "0":
        _store = host_store(address, port, int(os.environ["WORLD_SIZE"]))
        atexit.register(_wait_for_ranks, _store, int(os.environ["WORLD_SIZE"]) - 1)
        return
    _join_store(address, port)


def host_store(address: str, port: int, world_size: int) -> Any:
    """Rank 0's ``TCPStore`` server on the listening socket its task handed it (``STORE_FD_ENV``),
    never on a bind of its own (torch's would take every address of the host). Without
    ``AGENT_STORE_ENV`` while it starts, so that a store that cannot serve fails this rank
    (``TorchStoreError``) instead of quietly making it a client of whatever listens on the port."""
    import torch.distributed as dist

    fd = _listening_fd(address, port)
    os.set_inheritable(fd, False)  # the store's alone: not kept open by what the training function forks or starts
    try:
        with _without_env(AGENT_STORE_ENV):
            return dist.TCPStore(address, port, world_size, is_master=True, wait_for_workers=False,
                                 master_listen_fd=fd)
    except (RuntimeError, ValueError) as err:
        raise TorchStoreError("Rank 0 could not serve torch.distributed's store on the socket its task holds at "
                              "%s:%d (%s). Start the rank with the runner (launcher=\"torch\"), which hands it "
                              "that socket." % (address, port, err)) from err


def _listening_fd(address: str, port: int) -> int:
    """The descriptor ``STORE_FD_ENV`` names, checked: a socket listening on ``port``; else ``TorchStoreError``."""
    text = os.environ.get(STORE_FD_ENV, "")
    why = "%s is not set" % STORE_FD_ENV
    if text.isdigit():
        try:
            with socket.socket(fileno=os.dup(int(text))) as sock:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                why = "descriptor %s is %s on port %d" % (text, "listening" if listening else "not listening",
                                                          sock.getsockname()[1])
                if listening and sock.getsockname()[1] == port:
                    return int(text)
        except OSError as err:
            why = "descriptor %s is no socket (%s)" % (text, err)
    raise TorchStoreError("Rank 0 has no listening socket for torch.distributed's store at %s:%d (%s): it never "
                          "binds the port itself, where any address of the host reaches it and another process "
                          "can take it first. Start the rank with the runner (launcher=\"torch\"), which holds "
                          "MASTER_PORT and hands the socket to rank 0." % (address, port, why))


@contextlib.contextmanager
def _without_env(name: str) -> Iterator[None]:
    """``name`` unset in this process while inside (torch reads it with ``getenv``), then as it was."""
    value = os.environ.pop(name, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def _join_store(address: str, port: int) -> None:
    """Every rank but 0: wait (``STORE_WAIT_S``) until rank 0's store answers, then say so in it."""
    import datetime

    import torch.distributed as dist

    deadline = time.monotonic() + STORE_WAIT_S
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise _store_never_came(address, port) from None
            time.sleep(0.01)
    store = _bounded(lambda: dist.TCPStore(address, port, is_master=False,
                                           timeout=datetime.timedelta(seconds=READY_WAIT_S)),
                     max(deadline - time.monotonic(), 0.0), lambda: _store_never_came(address, port))
    store.add(READY_KEY, 1)


def _bounded(connect: Callable[[], Any], wait_s: float, error: Callable[[], Exception]) -> Any:
    """``connect()``, or ``error()`` raised once ``wait_s`` has passed or it failed. The task listens from
    its start, so torch's client connects at once and then waits in the socket's backlog until rank 0's
    store serves; torch's own timeout does not cover that wait (it released the GIL, a thread waits)."""
    got: queue.Queue = queue.Queue()

    def attempt() -> None:
        try:
            got.put(connect())
        except Exception as err:  # noqa: BLE001 - handed to the caller, which raises error() from it
            got.put(err)

    threading.Thread(target=attempt, name="torch-store-client", daemon=True).start()
    try:
        result = got.get(timeout=wait_s)
    except queue.Empty:
        raise error() from None
    if isinstance(result, Exception):
        raise error() from result
    return result


def _store_never_came(address: str, port: int) -> TorchStoreError:
    return TorchStoreError("Rank 0's torch.distributed store at %s:%d did not come up within %d s."
                           % (address, port, STORE_WAIT_S))


def _wait_for_ranks(store: Any, others: int) -> None:
    """Rank 0 at its normal end: until every other rank has reached the store (bounded)."""
    deadline = time.monotonic() + READY_WAIT_S
    while store.add(READY_KEY, 0) < others and time.monotonic() < deadline:
        time.sleep(0.01)
