"""Durable checkpoints while training: throughput with and without them, and each version's commit latency.

    .venv/bin/python benchmarks/checkpoint_commit.py [--launcher mpirun|gloo] [--rounds 3] [--mib 100]

Both contenders run the same function on a warm ``local[2]`` session, np=2: a small CNN on
synthetic images (``torch.set_num_threads(1)``), ``hvd.DistributedOptimizer``, timed steps for
``--seconds`` seconds; every ``--every`` seconds rank 0 writes a ``--mib`` MiB checkpoint into
``runtime.checkpoint_dir()`` (a temporary name, then a rename, as the documented rule says) and
notes the time of the rename.

* ``durable``: ``HorovodRunner(2, artifact_dir=...)``: each checkpoint becomes a version, shipped
  to the driver in the background and committed to ``artifact_dir`` while training goes on.
* ``local``: ``HorovodRunner(2)`` with no ``artifact_dir``: the same writes, nothing shipped.

They alternate for ``--rounds`` rounds. The script prints the median images/s per rank of each,
the ratio durable/local (target >= 0.98) and, for every committed version, the latency from rank
0's rename to the version's commit on the driver (``last_run.checkpoints``: one host, one clock;
target <= 2 s for 100 MB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import print_load, warm_local_session

TARGET_RATIO = 0.98
TARGET_LATENCY_S = 2.0


def train(seconds=20.0, every=4.0, mib=100, batch_size=32):
    """Train for ``seconds``; rank 0 writes a checkpoint every ``every`` s. Returns images/s per rank
    and, on rank 0, the rename time of each checkpoint by its step."""
    import os
    import time

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from airflow_provider_horovod import runtime

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(16 * 13 * 13, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    images, labels = torch.randn(16 * batch_size, 1, 28, 28), torch.randint(0, 10, (16 * batch_size,))
    block = os.urandom(1 << 20)
    renamed, steps = {}, 0
    hvd.allreduce(torch.zeros(1), name="clock")
    t0 = next_checkpoint = time.monotonic()
    while not hvd.broadcast_object(time.monotonic() - t0 >= seconds, root_rank=0):
        lo = (steps % 16) * batch_size
        optimizer.zero_grad()
        F.cross_entropy(model(images[lo:lo + batch_size]), labels[lo:lo + batch_size]).backward()
        optimizer.step()
        steps += 1
        if hvd.rank() == 0 and time.monotonic() >= next_checkpoint:
            next_checkpoint += every
            renamed[steps] = write_checkpoint(runtime.checkpoint_dir() / "model.bin", block, mib)
    rate = steps * batch_size / (time.monotonic() - t0)
    return {"rates": hvd.allgather_object(rate), "renamed": renamed}


def write_checkpoint(target, block: bytes, mib: int) -> float:
    import os
    import time

    with open(str(target) + ".tmp", "wb") as f:
        for _ in range(mib):
            f.write(block)
    os.replace(str(target) + ".tmp", target)
    return time.time()


def latencies(result: dict, checkpoints: list[dict]) -> list[float]:
    """Seconds from each committed version's rename on rank 0 to its commit on the driver."""
    renamed = {int(step): at for step, at in result["renamed"].items()}
    by_time = sorted(renamed.items(), key=lambda item: item[1])
    out = []
    for version in checkpoints:  # a version is the newest rename before its commit (coalescing skips some)
        before = [at for _, at in by_time if at <= version["time"]]
        if before:
            out.append(version["time"] - before[-1])
    return out


def one_round(spark, args, work: Path, r: int) -> dict:
    from airflow_provider_horovod import HorovodRunner

    kwargs = {"seconds": args.seconds, "every": args.every, "mib": args.mib}
    got = {}
    for name in (("durable", "local") if r % 2 == 0 else ("local", "durable")):
        artifact_dir = work / ("round-%d" % r) if name == "durable" else None
        runner = HorovodRunner(2, spark=spark, launcher=args.launcher, artifact_dir=artifact_dir,
                               driver_log_verbosity="log_callback_only")
        result = runner.run(train, **kwargs)
        got[name] = {"rate": statistics.mean(result["rates"]),
                     "latency": latencies(result, runner.last_run.checkpoints) if artifact_dir else []}
    print("round %d: durable %.0f img/s per rank, local %.0f; %d versions, latency %s s" % (
        r + 1, got["durable"]["rate"], got["local"]["rate"], len(got["durable"]["latency"]),
        " ".join("%.2f" % x for x in got["durable"]["latency"])), flush=True)
    return got


def report(rounds: list[dict]) -> bool:
    durable = statistics.median(g["durable"]["rate"] for g in rounds)
    local = statistics.median(g["local"]["rate"] for g in rounds)
    lat = [x for g in rounds for x in g["durable"]["latency"]]
    ratio, worst = durable / local, max(lat, default=float("inf"))
    print("\nimages/s per rank, median: durable %.0f, local %.0f" % (durable, local))
    print("ratio durable / local        %.3f  (target >= %.2f: %s)" % (ratio, TARGET_RATIO, "PASS" if ratio >= TARGET_RATIO else "MISS"))
    print("commit latency, %d versions  median %.2f s, max %.2f s  (target <= %.1f s: %s)" % (
        len(lat), statistics.median(lat) if lat else float("nan"), worst, TARGET_LATENCY_S,
        "PASS" if worst <= TARGET_LATENCY_S else "MISS"))
    return ratio >= TARGET_RATIO and worst <= TARGET_LATENCY_S


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("mpirun", "gloo"), default="mpirun")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="training time per run")
    parser.add_argument("--every", type=float, default=4.0, help="seconds between checkpoints")
    parser.add_argument("--mib", type=int, default=100, help="checkpoint size")
    args = parser.parse_args()
    from airflow_provider_horovod import HorovodRunner

    spark = warm_local_session("hvdrunner-checkpoint-commit")
    print_load("at the start")
    HorovodRunner(2, spark=spark, launcher=args.launcher, driver_log_verbosity="log_callback_only").run(
        train, seconds=2.0, every=100.0, mib=1)  # warm-up, untimed
    with tempfile.TemporaryDirectory(prefix="hvd-checkpoint-bench-") as tmp:
        rounds = [one_round(spark, args, Path(tmp), r) for r in range(args.rounds)]
    print_load("at the end")
    return 0 if report(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
