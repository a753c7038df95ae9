"""Pull a 1 GiB checkpoint from rank 0 to the driver; compare with ``cp`` on the same disk.

    .venv/bin/python benchmarks/artifact_transfer.py [--mib 1024] [--rounds 3] [--settle 10]

Rank 0 writes a checkpoint of ``--mib`` MiB into ``runtime.checkpoint_dir()``, and the runner pulls
it to ``artifact_dir``. Each round runs the job twice, once per way the pull can go:

- ``copy``: the default here. Rank 0's task is on the driver's host (``local[2]``), offers its
  folder, and the driver, having verified the offer, copies the files in the kernel.
- ``stream``: ``HVDRUNNER_ARTIFACT_TRANSPORT=stream``, the way files come from another host: 4 MiB
  frames, each signed, over the run's channel (here on loopback).

A pull's time is the driver's own measurement (the offer received to the last byte written).
``cp`` copies the same file on the same disk in the same round, and so does ``dd bs=4M`` (a copy
through user space, as the stream's receiver is). The driver process's peak RSS growth is sampled
every 10 ms during each run. Targets: throughput at least 0.5x ``cp``; RSS growth at most 150 MB.

Every timed contender starts after ``--settle`` seconds of quiet following a ``sync``. On these VMs
a write into memory the guest has not touched lately (page cache included) runs several times
slower than a write into pages freed a moment ago: freed pages go back to the host within seconds.
A pull always writes into such memory (rank 0 has just filled the page cache with the checkpoint),
so ``cp`` and ``dd`` are measured in that same state. For scale, the output also shows ``cp`` into
pages freed just before ("warm"), a state no pull can be in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import print_load, warm_local_session, write_checkpoint


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


def settle(seconds: float) -> None:
    """No dirty pages, and time for memory freed earlier to go back to the host (see above)."""
    os.sync()
    time.sleep(seconds)


def timed_copy(argv: list[str], source: Path, target: Path) -> float:
    """MiB/s of one copy command."""
    started = time.monotonic()
    subprocess.run(argv, check=True)
    speed = source.stat().st_size / (time.monotonic() - started) / 2**20
    os.remove(target)
    return speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of quiet before each timed contender")
    args = parser.parse_args()
    print_load("at the start")
    spark = warm_local_session("artifact-transfer-benchmark")

    from airflow_provider_horovod import HorovodRunner

    work = Path(tempfile.mkdtemp(prefix="artifact-bench-", dir=os.environ.get("BENCH_DIR")))
    speeds: dict[str, list[float]] = {"copy": [], "stream": [], "cp": [], "dd": [], "cp warm": []}
    rss: dict[str, list[float]] = {"copy": [], "stream": []}
    try:
        for i in range(args.rounds):
            for transport in ("copy", "stream"):
                os.environ["HVDRUNNER_ARTIFACT_TRANSPORT"] = "auto" if transport == "copy" else "stream"
                dest = work / ("run-%d-%s" % (i, transport))
                runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest,
                                       driver_log_verbosity="log_callback_only")
                settle(args.settle)
                with PeakRss() as peak:
                    runner.run(write_checkpoint, args.mib)
                if runner.last_run.artifact_transport != transport:
                    raise SystemExit("expected the %s path, the run took %s" % (transport, runner.last_run.artifact_transport))
                speeds[transport].append(runner.last_run.artifact_bytes / runner.last_run.artifact_transfer_s / 2**20)
                rss[transport].append(peak.growth_mb)
                source = dest / "checkpoints" / "model.bin"
                if transport == "copy":
                    cp = ["cp", str(source), str(work / "cp.bin")]
                    dd = ["dd", "if=%s" % source, "of=%s" % (work / "dd.bin"), "bs=4M", "status=none"]
                    settle(args.settle)
                    speeds["cp"].append(timed_copy(cp, source, work / "cp.bin"))
                    settle(args.settle)
                    speeds["dd"].append(timed_copy(dd, source, work / "dd.bin"))
                    speeds["cp warm"].append(timed_copy(cp, source, work / "cp.bin"))  # into the pages dd just freed
                shutil.rmtree(dest)
            print("round %d: copy %.0f MiB/s, stream %.0f MiB/s, cp %.0f MiB/s, dd bs=4M %.0f MiB/s, cp warm %.0f MiB/s, "
                  "driver RSS +%.1f / +%.1f MB" % (i + 1, speeds["copy"][-1], speeds["stream"][-1], speeds["cp"][-1],
                                                  speeds["dd"][-1], speeds["cp warm"][-1], rss["copy"][-1], rss["stream"][-1]))
    finally:
        os.environ.pop("HVDRUNNER_ARTIFACT_TRANSPORT", None)
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_load("at the end")
    print_medians(args.mib, args.rounds, speeds, rss)


def print_medians(mib: int, rounds: int, speeds: dict[str, list[float]], rss: dict[str, list[float]]) -> None:
    median = {k: statistics.median(v) for k, v in speeds.items()}
    print()
    print("checkpoint size                %d MiB, %d rounds, medians" % (mib, rounds))
    print("pull, same host (copy)         %.0f MiB/s" % median["copy"])
    print("pull, streamed (other host)    %.0f MiB/s" % median["stream"])
    print("cp                             %.0f MiB/s" % median["cp"])
    print("dd bs=4M                       %.0f MiB/s  (a copy through user space, as the stream's receiver is)" % median["dd"])
    print("cp, warm pages                 %.0f MiB/s  (for scale only: into pages freed a moment before)" % median["cp warm"])
    for transport in ("copy", "stream"):
        ratio = median[transport] / median["cp"]
        print("ratio %-6s / cp              %.3fx  (target >= 0.5x: %s)" % (transport, ratio, "PASS" if ratio >= 0.5 else "MISS"))
    print("ratio stream / dd              %.3fx" % (median["stream"] / median["dd"]))
    print("ratio copy / cp warm           %.3fx  (for scale only)" % (median["copy"] / median["cp warm"]))
    for transport in ("copy", "stream"):
        peak = max(rss[transport])
        print("driver peak RSS growth, %-6s %.1f MB  (target <= 150 MB: %s)" % (transport, peak, "PASS" if peak <= 150 else "MISS"))


if __name__ == "__main__":
    main()
