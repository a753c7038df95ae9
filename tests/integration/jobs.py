"""Training functions the integration tests run on real Horovod ranks.

This module is not installed anywhere, so the runner ships these functions by value, as it would
a function from a notebook or a DAG file.
"""

from __future__ import annotations

import os
import signal
import socket
import time


def allreduce_job(tag: str = "x"):
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    seen = hvd.allgather_object(
        {
            "device": runtime.device(),
            "rank": hvd.rank(),
            "size": hvd.size(),
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "controller": "mpi" if hvd.mpi_enabled() and os.environ.get("HOROVOD_CONTROLLER") == "mpi" else "gloo",
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "orte_tmpdir": os.environ.get("OMPI_MCA_orte_tmpdir_base"),  # from the orted that started the rank
        }
    )
    print("rank %d says hello %s" % (hvd.rank(), tag), flush=True)
    return {"tag": tag, "sum": total, "ranks": seen}


def layout_then_job(then=None, tag: str = "x", **kwargs):
    """``allreduce_job`` (the ranks' layout), then, in the same ranks, the job function ``then`` with
    ``kwargs``: one run shows both. ``then`` travels in the payload: a module of ``tests`` other than
    this one must be registered to go by value (``by_value``). Returns ``{"layout": ..., "then": ...}``."""
    layout = allreduce_job(tag)
    return {"layout": layout, "then": None if then is None else then(**kwargs)}


def by_value(*modules) -> None:
    """The executors cannot import ``tests``: jobs of these modules passed as arguments go by value."""
    import cloudpickle

    for module in modules:
        cloudpickle.register_pickle_by_value(module)


def optimizer_step_job(lr: float = 0.1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different on purpose: broadcast must make them equal
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x = torch.full((8, 4), float(hvd.rank() + 1))
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    weights = [w.detach().flatten().tolist() for w in model.parameters()]
    return hvd.allgather_object(weights)


def failing_job(fail_rank: int = 1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    if hvd.rank() == fail_rank:
        raise ValueError("boom from rank %d" % hvd.rank())
    while True:  # the other ranks wait in a collective that never completes
        hvd.allreduce(torch.ones(1))


def sigkill_job(victim: int = 1):
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        hvd.allreduce(torch.ones(1))


def hang_after_failure_job():
    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 0:
        time.sleep(1)
        raise RuntimeError("rank 0 gives up")
    time.sleep(10**6)  # not in any collective: only the runner can end this rank


def slow_job(steps: int = 600, marker: str = ""):
    import horovod.torch as hvd
    import torch

    hvd.init()
    for step in range(steps):
        hvd.allreduce(torch.ones(1))
        if step == 2 and marker and hvd.rank() == 0:
            open(marker, "w").close()
        time.sleep(0.1)
    return steps


def log_job():
    import horovod.torch as hvd

    from airflow_provider_horovod import runtime

    hvd.init()
    print("plain print from rank %d" % hvd.rank(), flush=True)
    runtime.log_to_driver("callback from rank %d" % hvd.rank())
    return runtime.rank(), runtime.size()


def checkpoint_job(epochs: int = 3, fail_at: int | None = None, in_flight_at_failure: bool = False, big_mb: int = 0):
    """Saves ``epoch-N.pt`` on rank 0 each epoch (write, then rename); resumes from resume_dir().

    ``fail_at``: rank 1 raises at the start of that epoch (after epoch ``fail_at - 1`` was saved).
    ``in_flight_at_failure``: rank 0 leaves a half-written ``*.tmp`` checkpoint behind first.
    ``big_mb``: rank 0 also writes a file of that many MiB (to make the transfer take time).
    """
    import glob

    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    start = 0
    resume = runtime.resume_dir()
    if resume is not None:
        saved = sorted(glob.glob(str(resume / "epoch-*.pt")), key=lambda p: int(p.rsplit("-", 1)[1][:-3]))
        if saved:
            state = torch.load(saved[-1])
            model.load_state_dict(state["model"])
            start = state["epoch"] + 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ckpt = runtime.checkpoint_dir()
    for epoch in range(start, epochs):
        if fail_at is not None and epoch == fail_at:
            if hvd.rank() == 0 and in_flight_at_failure:
                (ckpt / ("epoch-%d.pt.tmp" % epoch)).write_bytes(b"half a checkpoint")
            hvd.allreduce(torch.ones(1))
            if hvd.rank() == 1:
                raise RuntimeError("failing at epoch %d" % epoch)
            time.sleep(30)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(hvd.allreduce(torch.ones_like(p)))
        if hvd.rank() == 0:
            tmp = ckpt / ("epoch-%d.pt.tmp" % epoch)
            torch.save({"epoch": epoch, "model": model.state_dict()}, tmp)
            os.replace(tmp, ckpt / ("epoch-%d.pt" % epoch))
    if hvd.rank() == 0 and big_mb:
        with open(ckpt / "big.bin", "wb") as f:
            for _ in range(big_mb):
                f.write(os.urandom(1 << 20))
    seen = hvd.allgather_object(str(resume) if resume else None)
    timeline = hvd.allgather_object(os.environ.get("HOROVOD_TIMELINE"))
    import psutil

    ancestors = [task_pid(), *(p.pid for p in psutil.Process(task_pid()).parents())]  # its task's: see executor_jvm
    return {"start": start, "resume_seen": seen, "timeline_env": timeline, "rank0_ancestors": ancestors,
            "weights": [p.detach().flatten().tolist() for p in model.parameters()]}


def exit_job(victim: int = 1, when: str = "inside", code: int = 3):
    """Rank ``victim`` prints a few lines, then ends with ``code`` without raising: inside the
    function (``os._exit``) or while its interpreter shuts down after the function returned."""
    import atexit

    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == victim:
        for i in range(3):
            print("victim line %d" % i, flush=True)
        if when == "inside":
            os._exit(code)
        atexit.register(os._exit, code)  # runs after the function returned and the result was written
        return "returned"
    if when == "inside":
        while True:  # the others wait in a collective that never completes
            hvd.allreduce(torch.ones(1))
    return "returned"


def steps_job(steps: int = 100000, pause: float = 0.2):
    """Trains (one allreduce a step) until ``steps``; rank 0 prints ``step N`` after each, so a
    driver can act mid-training by watching the lines it streams."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    for step in range(steps):
        hvd.allreduce(torch.ones(1))
        if hvd.rank() == 0:
            print("step %d" % step, flush=True)
        time.sleep(pause)
    return {"steps": steps, "size": hvd.size(), "local_size": hvd.local_size()}


def checkpoint_then_sleep_job(step: int = 5, marker: str = ""):
    """Rank 0 commits ``step.txt`` (write, then rename), touches ``marker``; every rank then sleeps."""
    import horovod.torch as hvd

    from airflow_provider_horovod import runtime

    hvd.init()
    if hvd.rank() == 0:
        tmp = runtime.checkpoint_dir() / ".step.txt.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, runtime.checkpoint_dir() / "step.txt")
        if marker:
            open(marker, "w").close()
    time.sleep(600)


def durable_job(steps: int = 4, pause: float = 0.5, explicit: bool = False, marker: str = ""):
    """Rank 0 saves a checkpoint each step (``step.txt``, and ``weights.bin`` that changes only every
    other step), renamed into place or committed with ``runtime.commit_checkpoint``, then trains on
    for ``pause`` s; resumes after the step in ``resume_dir()``. ``marker``: touched after each step."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    resume = runtime.resume_dir()
    start = int((resume / "step.txt").read_text()) + 1 if resume is not None and (resume / "step.txt").exists() else 0
    ckpt = runtime.checkpoint_dir()
    for step in range(start, steps):
        hvd.allreduce(torch.ones(1))
        if hvd.rank() == 0:
            if step % 2 == 0:
                (ckpt / ".weights.bin.tmp").write_bytes(bytes([step % 256]) * 4096)
                os.replace(ckpt / ".weights.bin.tmp", ckpt / "weights.bin")
            (ckpt / ".step.txt.tmp").write_text(str(step))
            os.replace(ckpt / ".step.txt.tmp", ckpt / "step.txt")
            if explicit:
                runtime.commit_checkpoint(step=step, loss=1.0 / (step + 1))
            if marker:
                with open(marker, "w") as f:
                    f.write(str(step))
        time.sleep(pause)
    return {"start": start}


def host_versions_job(steps: int = 100000, pause: float = 0.5, weights_kb: int = 256):
    """Rank 0 commits one version a step with ``runtime.commit_checkpoint`` (``step.txt``;
    ``weights.bin``: ``weights_kb`` KiB of the step's byte; ``host.txt``: its host's address, as names
    repeat), then trains on for ``pause`` s; resumes after the step in ``resume_dir()``."""
    import horovod.torch as hvd
    import psutil
    import torch

    from airflow_provider_horovod import runtime

    host = next(a.address for addrs in psutil.net_if_addrs().values() for a in addrs  # names repeat; addresses do not
                if a.family == socket.AF_INET and not a.address.startswith("127."))

    hvd.init()
    resume = runtime.resume_dir()
    start = int((resume / "step.txt").read_text()) + 1 if resume is not None else 0
    ckpt = runtime.checkpoint_dir()
    for step in range(start, steps):
        hvd.allreduce(torch.ones(1))
        if hvd.rank() == 0:
            (ckpt / "weights.bin").write_bytes(bytes([step % 256]) * (weights_kb << 10))
            (ckpt / "step.txt").write_text(str(step))
            (ckpt / "host.txt").write_text(host)
            runtime.commit_checkpoint(step=step)
        time.sleep(pause)
    return {"start": start, "host": host}


def unpicklable_result_job():
    """Saves a checkpoint on rank 0, then returns what cannot be pickled (a lock)."""
    import threading

    from airflow_provider_horovod import runtime

    if runtime.rank() == 0:
        (runtime.checkpoint_dir() / "model.pt").write_bytes(b"weights")
    return threading.Lock()


def provider_error_job(fail_rank: int = 0):
    """Raises the provider's own Keras3NotSupportedError on ``fail_rank`` (as the Keras guard does)."""
    from airflow_provider_horovod import runtime
    from airflow_provider_horovod.exceptions import Keras3NotSupportedError

    if runtime.rank() == fail_rank:
        raise Keras3NotSupportedError("Keras 3 object given to Horovod (raised by the test)")
    return runtime.rank()


def uneven_batches_job(batches: int = 6, short_by: int = 2):
    """Rank 1 has ``short_by`` fewer batches than rank 0: it ends its epoch and allreduces its epoch
    loss while rank 0 still waits in the gradient allreduce of a batch rank 1 does not have (the
    classic uneven-shards hang). Rank 0 checkpoints each step it finishes (``step.txt``) and a
    resumed run starts after the step in ``resume_dir()``."""
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    resume = runtime.resume_dir()
    start = int((resume / "step.txt").read_text()) + 1 if resume is not None else 0
    mine = batches - (short_by if hvd.rank() == 1 else 0)
    for step in range(start, mine):
        hvd.allreduce(torch.ones(4), name="grad.fc1")
        if hvd.rank() == 0:
            (runtime.checkpoint_dir() / ".step.txt.tmp").write_text(str(step))
            os.replace(runtime.checkpoint_dir() / ".step.txt.tmp", runtime.checkpoint_dir() / "step.txt")
    hvd.allreduce(torch.ones(1), name="epoch_loss")
    return {"start": start}


def task_pid() -> int:
    """The pid of this rank's barrier task (its Spark Python worker), as the plan names it: a rank forked
    by a warm process (rank/warm.py) is that process's child, not its task's."""
    from airflow_provider_horovod import runtime
    from airflow_provider_horovod.runner.names import ENV_PLAN
    from airflow_provider_horovod.runner.plan import Plan

    with open(os.environ[ENV_PLAN]) as f:
        return Plan.from_json(f.read()).slots[runtime.rank()].task_pid


def executor_jvm():
    """The JVM of this rank's executor: an ancestor of the rank's task (its Spark Python worker, under
    the pyspark daemon). Not one of a forked rank's own ancestors: the warm process belongs to the
    executor's daemon and outlives the Python worker that started it (then init is its parent)."""
    import psutil

    return next(p for p in psutil.Process(task_pid()).parents() if p.name() == "java")


def restartable_job(steps: int = 12, pause: float = 0.3, collective: str = "horovod", loss: str = "",
                    losses: int = 1, marker: str = "", victim: int | list[int] = 1, with_dataset: bool = False):
    """Rank 0 commits ``step.txt`` each step with ``runtime.commit_checkpoint``; resumes after the step
    in ``resume_dir()``. In each of the first ``losses`` attempts rank ``victim`` (a list: ``victim[n]`` in
    attempt ``n``) loses its infrastructure three steps after the attempt's first (attempt 0: after step 3):
    ``loss="task"`` kills its Spark task's Python worker (SIGKILL, from the rank: a
    signal the task did not send itself; gloo and torch, whose rank is the task's child); ``loss="jvm"`` writes the pid of the executor JVM hosting
    it to ``marker`` for the driver to kill, and that attempt then waits for the loss. ``collective``:
    ``"horovod"`` (mpirun, gloo) or ``"torch"`` (launcher="torch"). Returns where it started (and,
    ``with_dataset``, how many rows rank 0's shard of ``dataset=`` holds)."""
    import psutil
    import torch

    from airflow_provider_horovod import runtime

    if collective == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def allreduce():
            dist.all_reduce(torch.ones(1))
    else:
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def allreduce():
            hvd.allreduce(torch.ones(1))
    resume = runtime.resume_dir()
    start = int((resume / "step.txt").read_text()) + 1 if resume is not None else 0
    doomed = loss and runtime.attempt() < losses
    if isinstance(victim, list):
        victim = victim[runtime.attempt()] if doomed else -1
    for step in range(start, steps):
        allreduce()
        if rank == 0:
            (runtime.checkpoint_dir() / "step.txt").write_text(str(step))
            runtime.commit_checkpoint(step=step)
        if doomed and step >= start + 3:
            time.sleep(0.5)  # the version of this step reaches the driver first
            if rank == victim and loss == "task":
                os.kill(task_pid(), signal.SIGKILL)  # gloo, torch: the rank's task runs on the rank's executor
            if rank == victim and loss == "jvm":
                java = executor_jvm()
                with open(marker + ".tmp", "w") as f:
                    f.write(str(java.pid))
                os.replace(marker + ".tmp", marker)
            time.sleep(600)  # the loss ends this attempt
        time.sleep(pause)
    result = {"start": start, "attempt": runtime.attempt(), "size": size}
    if collective == "torch":  # torchrun's own count of the group's restarts, and its bound
        result["torchelastic"] = [os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["TORCHELASTIC_MAX_RESTARTS"]]
    if with_dataset:  # the rows of this rank's shard of the run's dataset=, split for this attempt's size
        result["rows"] = runtime.dataset().num_rows
    return result


def preemptible_job(steps: int = 12, pause: float = 0.3, marker: str = "", with_dataset: bool = False,
                    notice: str = "decommission"):
    """Rank 0 commits a version only when the ranks agree, through an allreduce, that the attempt is
    being preempted (``runtime.preempting()``), then every rank waits for the loss. In attempt 0,
    after step 3, rank 1 either writes its executor JVM's pid to ``marker`` (``notice="decommission"``:
    for the driver to decommission its worker and kill it later) or sends SIGTERM to its barrier task
    (``notice="sigterm"``: gloo, torch, whose rank is the task's child), and training goes on until
    the notice. Returns where it started, the attempt and the size (``with_dataset``: and the rows of
    rank 0's shard)."""
    import horovod.torch as hvd
    import psutil
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    resume = runtime.resume_dir()
    step = int((resume / "step.txt").read_text()) + 1 if resume is not None else 0
    start = step
    while step < steps or runtime.attempt() == 0:  # attempt 0 trains until the notice
        hvd.allreduce(torch.ones(1), name="step")
        if hvd.allreduce(torch.tensor([float(runtime.preempting())]), name="notice", op=hvd.Max).item() > 0:
            if hvd.rank() == 0:  # every rank stops after this step: the version holds every step done
                (runtime.checkpoint_dir() / "step.txt").write_text(str(step))
                runtime.commit_checkpoint(step=step)
            time.sleep(600)  # the loss ends this attempt
        if runtime.attempt() == 0 and step == 3 and hvd.rank() == 1 and notice == "sigterm":
            os.kill(task_pid(), signal.SIGTERM)
        elif runtime.attempt() == 0 and step == 3 and hvd.rank() == 1:
            java = executor_jvm()
            with open(marker + ".tmp", "w") as f:
                f.write(str(java.pid))
            os.replace(marker + ".tmp", marker)
        step += 1
        time.sleep(pause)
    result = {"start": start, "attempt": runtime.attempt(), "size": hvd.size()}
    if with_dataset:
        result["rows"] = runtime.dataset().num_rows
    return result


def sleeps_in_user_code(seconds: float) -> None:
    time.sleep(seconds)  # the line a stalled rank's failure shows (test_stall.py)


def stalling_job(collective: str = "horovod", how: str = "sleep", marker: str = "", steps: int = 6,
                 attempts: int = 1000):
    """Every rank allreduces once a step; at step 3 rank 1 stalls before the others' next collective:
    ``how="sleep"`` sleeps an hour in a user function, ``how="sigstop"`` stops its own process. It
    writes when it stalled (``time.time()``) to ``marker`` first; only in the first ``attempts``
    attempts of the run. ``collective``: ``"horovod"`` (mpirun, gloo) or ``"torch"`` (launcher="torch")."""
    import torch

    from airflow_provider_horovod import runtime

    if collective == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def collective(tensor):
            dist.all_reduce(tensor)
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()

        def collective(tensor):
            hvd.allreduce(tensor, name="grad.step")
    for step in range(steps):
        if step == 3 and rank == 1 and runtime.attempt() < attempts:
            with open(marker, "w") as out:
                out.write(repr(time.time()))
            if how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            sleeps_in_user_code(3600)
        collective(torch.ones(4))
        time.sleep(0.05)
    return step


def saves_a_checkpoint_job():
    """Rank 0 saves two files in runtime.checkpoint_dir() and returns the rank count."""
    from airflow_provider_horovod import runtime

    if runtime.rank() == 0:
        (runtime.checkpoint_dir() / "model.pt").write_bytes(b"weights")
        (runtime.checkpoint_dir() / "optimizer.pt").write_bytes(b"state")
    return runtime.size()
