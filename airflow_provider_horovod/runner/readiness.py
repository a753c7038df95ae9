"""Is each host ready for its ranks? What a barrier task reports about its container, and the
driver's verdict on it before any rank starts (pure functions of the tasks' facts).

``/dev/shm``: Open MPI's shared-memory transport (vader, its segments in ``/dev/shm``), NCCL's SHM
transport and PyTorch's DataLoader workers (every batch a worker hands over is a shared-memory
tensor) all allocate there. Docker and Kubernetes give a container a 64 MiB ``/dev/shm``; when it
runs out the ranks see "No space left on device", a bus error (SIGBUS at the first touch of a page
the tmpfs cannot back) or a hang (pytorch#16979, horovod#1081, NVIDIA/nccl#525).

- **Warn** when a host's ``/dev/shm`` is smaller than ``WARN_PER_RANK`` (512 MiB) times the ranks on
  it: one DataLoader with 4 workers prefetching 2 batches of 64 224x224 RGB images holds
  4 x 2 x 38.5 MiB = 308 MiB there, and NCCL's SHM buffers for a few peers add tens of MiB; Docker's
  64 MiB is an eighth of that for a single rank. Training that uses none of them (CPU, Gloo, no
  DataLoader workers) runs fine, so it is a warning, not a refusal.
- **Refuse** when ``/dev/shm`` has less than ``REFUSE_FREE`` (1 MiB) free on a host: a full tmpfs.
  Every rank imports Python's ``multiprocessing`` locks, Horovod and torch, which create their
  semaphores and segments there: the ranks would fail at their first allocation, after every slot
  was taken and every host started, with an error that names nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from airflow_provider_horovod.exceptions import ExecutorMismatchError
from airflow_provider_horovod.runner.environment import stack_differences
from airflow_provider_horovod.runner.events import Failure

if TYPE_CHECKING:
    from airflow_provider_horovod.runner.plan import TaskFacts

SHM = "/dev/shm"
MIB = 1024 * 1024
WARN_PER_RANK = 512 * MIB
REFUSE_FREE = 1 * MIB
FIX = ("give the container a larger /dev/shm: docker run --shm-size=8g (or --ipc=host); on Kubernetes, a volume "
       "{emptyDir: {medium: Memory, sizeLimit: 8Gi}} mounted at /dev/shm in the executor pod template")


def shm_of_this_host(path: str = SHM) -> tuple[int, int]:
    """``(size, free)`` of ``/dev/shm`` in bytes; ``(-1, -1)`` when there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1, -1
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def host_text(f: TaskFacts) -> str:
    """``host trainer-0 (executor 10.1.0.3:39201, address 10.1.0.3)``: a user finds the container by
    its own name, the runner by its executor (names can repeat; executors cannot)."""
    return "host %s (executor %s, address %s)" % (f.machine or "?", f.executor, f.address)


def _hosts(facts: Iterable[TaskFacts]) -> list[tuple[TaskFacts, int]]:
    """One task's facts per host identity (its executor), with the number of ranks there."""
    out: dict[str, list[TaskFacts]] = {}
    for f in sorted(facts, key=lambda f: f.partition):
        out.setdefault(f.executor, []).append(f)
    return [(tasks[0], len(tasks)) for tasks in out.values()]


def shm_refusal(facts: Iterable[TaskFacts]) -> str | None:
    """Why the ranks cannot start (a full ``/dev/shm`` on some host), or ``None``."""
    for f, ranks in _hosts(facts):
        if 0 <= f.shm_free < REFUSE_FREE:
            return ("/dev/shm on %s is full (%s free of %s) and its %d rank(s) would fail at their first "
                    "shared-memory allocation (Python's multiprocessing locks, Open MPI, NCCL, torch): "
                    "free it (files left by earlier jobs) or %s." % (host_text(f), size_text(f.shm_free),
                                                                     size_text(f.shm_size), ranks, FIX))
    return None


def shm_warnings(facts: Iterable[TaskFacts]) -> list[str]:
    """A warning for each host whose ``/dev/shm`` is small for its ranks."""
    out = []
    for f, ranks in _hosts(facts):
        if 0 <= f.shm_size < WARN_PER_RANK * ranks:
            out.append("/dev/shm on %s is %s for %d rank(s), below the %s this provider asks per rank: NCCL, "
                       "Open MPI's shared-memory transport and PyTorch's DataLoader workers fail there with \"No "
                       "space left on device\", a bus error or a hang when it runs out. If the ranks use them, %s."
                       % (host_text(f), size_text(f.shm_size), ranks, size_text(WARN_PER_RANK), FIX))
    return out


def size_text(size: int) -> str:
    if size >= 1024 * MIB:
        return "%.3g GiB" % (size / (1024 * MIB))
    return "%.3g MiB" % (size / MIB)


def check_facts(driver_python: str, facts: list[TaskFacts], driver_stack: dict[str, str] | None = None) -> Failure | None:
    """Why an executor cannot run the job, in words that say what to fix; None when all can.
    ``driver_stack``: the driver's ``environment.stack_of_this_host()``, which every executor's must equal."""
    driver_mm = ".".join(driver_python.split(".")[:2])
    for f in facts:
        differences = stack_differences(driver_stack or {}, f.stack)
        if differences:
            return Failure("The executor %s (partition %d) runs another environment than the driver: %s. Give the "
                           "executors the driver's environment (a packed virtualenv in spark.archives, or the same "
                           "image; see docs/how-to.md)." % (f.executor, f.partition, "; ".join(differences)),
                           executor=f.executor, error_class=ExecutorMismatchError.__name__)
        if ".".join(f.python.split(".")[:2]) != driver_mm:
            return Failure("Python %s on executor %s differs from the driver's %s. Point PYSPARK_PYTHON at the "
                           "same Python version on the driver and the executors." % (f.python, f.executor, driver_python),
                           executor=f.executor, error_class=ExecutorMismatchError.__name__)
        if f.missing:
            return Failure("%s not found on executor %s (PATH of the task). Install Open MPI on every executor "
                           "(apt-get install openmpi-bin), or use launcher='gloo'." % (" and ".join(f.missing), f.executor),
                           executor=f.executor, error_class=ExecutorMismatchError.__name__)
    refusal = shm_refusal(facts)
    return Failure(refusal) if refusal is not None else None
