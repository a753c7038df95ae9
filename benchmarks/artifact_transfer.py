"""Pull a 1 GiB checkpoint from rank 0 to the driver; compare with ``cp`` on the same disk.

    .venv/bin/python benchmarks/artifact_transfer.py [--mib 1024] [--rounds 3]

Rank 0 writes a checkpoint of ``--mib`` MiB into ``runtime.checkpoint_dir()``; the runner streams it
to ``artifact_dir`` over its authenticated channel. The transfer time is the driver's own
measurement of that stream (first byte to last byte); ``cp`` copies the same file on the same disk
in the same round, and so does ``dd bs=4M`` (a copy through user space, which the pull also is;
``cp`` uses copy_file_range and never leaves the kernel). The driver process's peak RSS growth is sampled every 10 ms during the run.
Targets: throughput at least 0.5x ``cp``; RSS growth at most 150 MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil


def write_checkpoint(mib: int) -> int:
    import horovod.torch as hvd
    import torch

    from airflow_provider_horovod import runtime

    hvd.init()
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == 0:
        block = os.urandom(1 << 20)
        target = runtime.checkpoint_dir() / "model.bin"
        with open(str(target) + ".tmp", "wb") as f:
            for _ in range(mib):
                f.write(block)
        os.replace(str(target) + ".tmp", target)
        os.sync()  # every contender starts with no dirty pages to write back (outside the timed part)
    return mib


class PeakRss:
    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    work = Path(tempfile.mkdtemp(prefix="artifact-bench-", dir=os.environ.get("BENCH_DIR")))
    pulled, copied, userspace, rss = [], [], [], []
    try:
        for i in range(args.rounds):
            dest = work / ("run-%d" % i)
            runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest, driver_log_verbosity="log_callback_only")
            with PeakRss() as peak:
                runner.run(write_checkpoint, args.mib)
            size = runner.last_run["artifact_bytes"]
            pulled.append(size / runner.last_run["artifact_transfer_s"] / 2**20)
            rss.append(peak.growth_mb)
            source = dest / "checkpoints" / "model.bin"
            os.sync()
            started = time.monotonic()
            subprocess.run(["cp", str(source), str(work / "cp.bin")], check=True)
            copied.append(source.stat().st_size / (time.monotonic() - started) / 2**20)
            os.remove(work / "cp.bin")
            os.sync()
            started = time.monotonic()
            subprocess.run(["dd", "if=%s" % source, "of=%s" % (work / "dd.bin"), "bs=4M", "status=none"], check=True)
            userspace.append(source.stat().st_size / (time.monotonic() - started) / 2**20)
            os.remove(work / "dd.bin")
            shutil.rmtree(dest)
            print("round %d: pulled %.0f MiB/s, cp %.0f MiB/s, dd bs=4M %.0f MiB/s, driver RSS +%.1f MB"
                  % (i + 1, pulled[-1], copied[-1], userspace[-1], rss[-1]))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(pulled) / statistics.median(copied)
    print()
    print("checkpoint size           %d MiB" % args.mib)
    print("pull throughput (median)  %.0f MiB/s" % statistics.median(pulled))
    print("cp throughput (median)    %.0f MiB/s" % statistics.median(copied))
    print("dd bs=4M throughput       %.0f MiB/s  (a copy through user space, as the pull is)" % statistics.median(userspace))
    print("ratio pull / cp           %.2fx  (target >= 0.5x: %s)" % (ratio, "PASS" if ratio >= 0.5 else "MISS"))
    print("ratio pull / dd           %.2fx" % (statistics.median(pulled) / statistics.median(userspace)))
    print("driver peak RSS growth    %.1f MB  (target <= 150 MB: %s)" % (max(rss), "PASS" if max(rss) <= 150 else "MISS"))


if __name__ == "__main__":
    main()
