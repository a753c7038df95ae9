"""What training code running inside a rank can ask of the runner.

Import it inside the training function::

    def train():
        import horovod.torch as hvd
        from airflow_provider_horovod import runtime

        hvd.init()
        runtime.log_to_driver("epoch 1 done")          # reaches the driver, whatever the verbosity
        torch.save(state, runtime.checkpoint_dir() / "epoch-1.pt")   # rank 0's folder comes back

Outside a rank every function answers as a single local process would (rank 0 of 1).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.launchers import contract_names

_client = None  # set by the rank process (``runner.rank.worker``) to its ChannelClient
_reporter = None  # rank 0's ``runner.rank.reports.Reporter``, set by the rank process
_watch = None  # the rank's ``runner.rank.stacks.Watch`` (the stall rule's pulse), set by the rank process


def _int(*names_: str, default: int) -> int:
    for name in names_:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


# The runner's own view first (every launcher), then the contract of each launcher that runs Horovod
# (the launchers' table: MPI's, then Gloo's), as training code run outside the runner reads them.
_CONTRACT = {what: contract_names(what, horovod=True) for what in
             ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "hostname")}


def rank() -> int:
    return _int(names.ENV_RANK, *_CONTRACT["rank"], default=0)


def size() -> int:
    return _int(names.ENV_SIZE, *_CONTRACT["size"], default=1)


def local_rank() -> int:
    return _int(names.ENV_LOCAL_RANK, *_CONTRACT["local_rank"], default=0)


def local_size() -> int:
    return _int(names.ENV_LOCAL_SIZE, *_CONTRACT["local_size"], default=1)


def cross_rank() -> int:
    return _int(names.ENV_CROSS_RANK, *_CONTRACT["cross_rank"], default=0)


def cross_size() -> int:
    return _int(names.ENV_CROSS_SIZE, *_CONTRACT["cross_size"], default=1)


def hostname() -> str:
    """The host identity the runner gave this rank (one per Spark executor)."""
    return os.environ.get(names.ENV_HOSTNAME) or next(
        (os.environ[name] for name in _CONTRACT["hostname"] if name in os.environ), "localhost")


def device(framework: str = "torch") -> str:
    """This rank's device, as ``framework`` names it: ``"cuda:0"`` (TensorFlow: ``"/GPU:0"``) when
    Spark gave the rank's task GPUs, whatever their addresses on the machine; else, when this
    process sees GPUs Spark does not manage (``np < 0`` on a GPU machine, a cluster without
    ``spark.task.resource.gpu.amount``), the one its local rank maps to (``cuda:<local_rank %
    count>``, Horovod's recipe); else ``"cpu"`` (``"/CPU:0"``).

    Spark sets ``CUDA_VISIBLE_DEVICES`` to the task's own GPUs, so inside the rank they are numbered
    from 0: ``torch.cuda.set_device(hvd.local_rank())`` asks for a device the rank cannot see as
    soon as two tasks share a machine (``invalid device ordinal``). Use
    ``torch.cuda.set_device(runtime.device())`` or ``model.to(runtime.device())`` instead.
    """
    if framework not in ("torch", "tensorflow"):
        raise ValueError("framework must be 'torch' or 'tensorflow'; got %r" % (framework,))
    if os.environ.get(names.ENV_GPUS):
        index: int | None = 0
    else:
        count = _visible_gpus(framework)
        index = local_rank() % count if count else None
    if framework == "tensorflow":
        return "/CPU:0" if index is None else "/GPU:%d" % index
    return "cpu" if index is None else "cuda:%d" % index


def _visible_gpus(framework: str) -> int:
    """How many GPUs ``framework`` sees in this process (0 when it is not installed)."""
    try:
        if framework == "tensorflow":
            import tensorflow as tf

            return len(tf.config.list_physical_devices("GPU"))
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def in_runner() -> bool:
    return names.ENV_TASK_DIR in os.environ


def log_to_driver(message: object) -> None:
    """Send ``message`` to the driver, whatever ``driver_log_verbosity`` is: to its
    ``airflow_provider_horovod.ranks`` logger when that shows INFO lines (Airflow's task log), else
    to its stdout."""
    from airflow_provider_horovod.runner.messages import Logs

    text = str(message)
    if _client is not None and _client.connected:
        for batch in Logs.batches(rank(), text.splitlines() or [""], callback=True):
            _client.send(batch)
    else:
        print(text, flush=True)


def report(step: int | None = None, total_steps: int | None = None, **metrics: float) -> None:
    """Report training progress: ``step`` of ``total_steps`` and named numbers (``loss=0.41``).

    Call it on every rank, as often as every step: rank 0's reports are the job's (the task log's
    progress line, the try's ``metrics.jsonl``, the Horovod view, MLflow), the other ranks' calls
    do nothing. The newest report reaches the driver at most twice a second; the reports between
    are dropped, so reporting costs training nothing measurable. A value that is not a finite
    number (a tensor: call ``.item()``) raises ``TypeError``/``ValueError`` on every rank.
    """
    import time

    from airflow_provider_horovod.runner.messages import Report

    made = Report.make(time.time(), step, total_steps, metrics)
    if _watch is not None:
        _watch.progress()  # a report is progress for the stall rule, on every rank
    if _reporter is not None and rank() == 0:
        _reporter.offer(made)


def checkpoint_dir() -> Path:
    """The folder to save checkpoints in.

    On rank 0 it is the folder the runner pulls back after the run; on every other rank it is a
    scratch folder that is thrown away, so "save only on rank 0" code works unchanged. What makes
    a checkpoint *version* (kept for the whole run, resumed from by a restart) is the commit rule of
    docs/runtime.md: the folder at each ``commit_checkpoint()`` call; in a run that never calls it,
    at each file renamed into place from a temporary name or closed under its final name. A file
    being written when the run fails is never offered as complete.
    """
    base = os.environ.get(names.ENV_TASK_DIR)
    if base is None:
        path = Path.cwd() / names.CHECKPOINTS_DIR
    else:
        path = names.TaskDir(base).rank_folder(rank()) / names.CHECKPOINTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def commit_checkpoint(step: int | None = None, **metrics: float) -> None:
    """Rank 0: the checkpoint folder as it is now is one consistent version; ship and commit it in
    the background (training goes on at once). Once an attempt has called this, only its calls make
    versions: call it after every save (a save no call takes within 30 s is named in a warning; the
    commit rule of docs/runtime.md). ``step`` and ``metrics`` go into the version's marker; they
    follow ``report()``'s rules (an int >= 0, finite numbers), checked at the call on every rank: ``TypeError`` or
    ``ValueError`` says what to pass. Other ranks: nothing else happens. An empty checkpoint folder
    is no version: the call warns and does nothing."""
    import time

    from airflow_provider_horovod.runner.messages import Report
    from airflow_provider_horovod.runner.records import CommitRequest
    from airflow_provider_horovod.runner.task.shipper import request_commit

    made = Report.make(time.time(), step, None, metrics)
    base = os.environ.get(names.ENV_TASK_DIR)
    if base is None or rank() != 0:
        return
    folder = checkpoint_dir()
    if not any(folder.iterdir()):
        warnings.warn("runtime.commit_checkpoint(step=%r): %s is empty, so there is no checkpoint to commit; write "
                      "its files first." % (step, folder), stacklevel=2)
        return
    request_commit(names.TaskDir(base), folder, CommitRequest(time=made.time, step=made.step, metrics=dict(made.metrics)))


def dataset(remainder: str = "wrap"):
    """This rank's shard of the run's ``dataset=`` (a ``runner.rank.shard.Shard``): ``num_rows``,
    ``schema``, ``iter_batches()``, ``steps()``, ``to_torch()``, ``to_tf()``.

    Every rank gets the same ``steps()``: ``remainder="wrap"`` reads ``ceil(rows / np)`` rows per
    epoch (a shorter shard wraps around), ``"drop"`` reads ``floor(rows / np)``.
    """
    from airflow_provider_horovod.exceptions import DatasetError
    from airflow_provider_horovod.runner.rank.shard import Shard

    base = os.environ.get(names.ENV_TASK_DIR)
    if base is None:
        raise DatasetError("runtime.dataset() works inside a rank of a run given dataset= (HorovodRunner(np, "
                           "dataset=...), or the operator's dataset=); this process is not a rank.")
    path = names.TaskDir(base).dataset
    if not path.exists():
        raise DatasetError("runtime.dataset() found no dataset: this run was started without dataset=. Pass a table "
                           "name, a Spark SQL query or a DataFrame as dataset= to HorovodRunner or the operator.")
    return Shard(path, remainder)


def resume_dir() -> Path | None:
    """The checkpoint folder given as ``resume_from``, present on every rank, or ``None``."""
    value = os.environ.get(names.ENV_RESUME_DIR)
    return Path(value) if value else None


def attempt() -> int:
    """Which attempt of the run this is: ``0``, then ``1``, ``2``, ... after each restart inside the
    same try (``max_restarts``: an executor or host was lost). A restarted attempt's ``resume_dir()``
    is the newest checkpoint version the driver committed; outside a rank, ``0``."""
    return _int(names.ENV_ATTEMPT, default=0)


def preempting() -> bool:
    """Whether Spark is decommissioning an executor of this attempt (a drained node, a reclaimed spot
    instance, with ``spark.decommission.enabled``): the attempt is about to lose it. Rank 0 commits a
    checkpoint now (``commit_checkpoint()``); the restart that follows waits for that version.
    Ranks can learn it a step apart: agree on it through a collective before acting (the how-to's
    recovery section). A ``stat`` per call; ``False`` outside a rank."""
    from airflow_provider_horovod.runner.rank import preemption

    return preemption.preempting()


def on_preemption(callback: Callable[[], None]) -> None:
    """Call ``callback()`` once, from a thread of this rank, when ``preempting()`` turns true."""
    from airflow_provider_horovod.runner.rank import preemption

    preemption.on_preemption(callback)
