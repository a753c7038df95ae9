"""What training code running inside a rank can ask of the runner.

Import it inside the training function::

    def train():
        import horovod.torch as hvd
        from airflow_provider_horovod import runtime

        hvd.init()
        runtime.log_to_driver("epoch 1 done")          # always reaches the driver's log
        torch.save(state, runtime.checkpoint_dir() / "epoch-1.pt")   # rank 0's folder comes back

Outside a rank every function answers as a single local process would (rank 0 of 1).
"""

from __future__ import annotations

import os
from pathlib import Path

_client = None  # set by the rank process (``runner.worker``) to its ChannelClient


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rank() -> int:
    return _int("HVDRUNNER_RANK", _int("HOROVOD_RANK", _int("OMPI_COMM_WORLD_RANK", 0)))


def size() -> int:
    return _int("HVDRUNNER_SIZE", _int("HOROVOD_SIZE", _int("OMPI_COMM_WORLD_SIZE", 1)))


def local_rank() -> int:
    return _int("HVDRUNNER_LOCAL_RANK", _int("HOROVOD_LOCAL_RANK", _int("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def local_size() -> int:
    return _int("HVDRUNNER_LOCAL_SIZE", _int("HOROVOD_LOCAL_SIZE", _int("OMPI_COMM_WORLD_LOCAL_SIZE", 1)))


def cross_rank() -> int:
    return _int("HVDRUNNER_CROSS_RANK", _int("HOROVOD_CROSS_RANK", 0))


def cross_size() -> int:
    return _int("HVDRUNNER_CROSS_SIZE", _int("HOROVOD_CROSS_SIZE", 1))


def hostname() -> str:
    """The host identity the runner gave this rank (one per Spark executor)."""
    return os.environ.get("HVDRUNNER_HOSTNAME") or os.environ.get("HOROVOD_HOSTNAME", "localhost")


def in_runner() -> bool:
    return "HVDRUNNER_TASK_DIR" in os.environ


def log_to_driver(message: object) -> None:
    """Send ``message`` to the driver's log, whatever ``driver_log_verbosity`` is."""
    text = str(message)
    if _client is not None and _client.connected:
        _client.send({"t": "logs", "rank": rank(), "lines": text.splitlines() or [""], "callback": True})
    else:
        print(text, flush=True)


def checkpoint_dir() -> Path:
    """The folder to save checkpoints in.

    On rank 0 it is the folder the runner pulls back after the run; on every other rank it is a
    scratch folder that is thrown away, so "save only on rank 0" code works unchanged.
    Write a checkpoint under a temporary name and rename it when complete: a file being written
    when the run fails is never offered as complete.
    """
    base = os.environ.get("HVDRUNNER_TASK_DIR")
    if base is None:
        path = Path.cwd() / "checkpoints"
    elif rank() == 0:
        path = Path(base) / "artifacts" / "checkpoints"
    else:
        path = Path(base) / ("scratch-rank-%d" % rank()) / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resume_dir() -> Path | None:
    """The checkpoint folder given as ``resume_from``, present on every rank, or ``None``."""
    value = os.environ.get("HVDRUNNER_RESUME_DIR")
    return Path(value) if value else None
