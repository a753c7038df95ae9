"""Pull a checkpoint from a worker host over a shaped link; compare with plain TCP over that link.

    .venv/bin/python benchmarks/artifact_transfer_hosts.py [--mib 1024] [--rounds 3] [--rate 1gbit]

Needs root: it builds the multi-host test bed (``tests/integration/netbed.py``): a driver host and
one worker host in network namespaces on a bridge, the worker's link shaped with ``tc tbf`` to
``--rate``, a Spark standalone master on the driver host and a worker (2 cores) on the worker host.
The driver's side runs inside the driver's namespace. Each round, in alternating order:

- ``pull``: ``HorovodRunner(2)`` on the worker host; rank 0 writes a ``--mib`` checkpoint into
  ``runtime.checkpoint_dir()`` (its host's own /tmp, which the driver cannot see), and the runner
  streams it to ``artifact_dir`` on the driver. Time: the driver's own (offer to last byte written).
- ``tcp``: the same number of bytes, from a file on the worker host's /tmp, sent with
  ``socket.sendfile`` over one TCP connection to the driver, which writes it to a file in the same
  folder as the pull's: the link's and the disk's speed, with no framing, MAC or protocol.

Then the same rounds with the link unshaped. Targets (shaped): pull >= 0.9x tcp; driver RSS growth
(peak during a pull, sampled every 10 ms) <= 150 MB. Unshaped, the ratio is printed for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SENDER = """
import socket, sys, time
addr, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with socket.create_connection((addr, port)) as s, open(path, 'rb') as f:
    s.sendfile(f)
"""


def tcp_transfer(bed, worker, source: str, dest: Path) -> float:
    """MiB/s of one plain TCP transfer of ``source`` (on the worker host) into ``dest`` (on the driver)."""
    listener = socket.socket()
    listener.bind((bed.driver.address, 0))
    listener.listen(1)
    got: dict[str, float] = {}

    def receive() -> None:
        conn, _ = listener.accept()
        started = time.monotonic()
        size = 0
        with conn, open(dest, "wb") as out:
            buf = bytearray(4 << 20)
            view = memoryview(buf)
            while True:
                n = conn.recv_into(view)
                if not n:
                    break
                out.write(view[:n])
                size += n
        got["speed"] = size / (time.monotonic() - started) / 2**20

    thread = threading.Thread(target=receive)
    thread.start()
    bed.run(worker, [sys.executable, "-c", SENDER, bed.driver.address, str(listener.getsockname()[1]), source],
            check=True)
    thread.join()
    listener.close()
    os.remove(dest)
    return got["speed"]


def driver_side(bed_json: str, master: str, conf: dict, args) -> dict:
    """Runs in the driver's namespace: the rounds, shaped then unshaped."""
    from _common import write_checkpoint
    from artifact_transfer import PeakRss
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner
    from tests.integration.netbed import NetBed

    bed = NetBed.from_json(bed_json)
    worker = bed.workers[0]
    builder = SparkSession.builder.master(master).appName("artifact-transfer-hosts")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(4, numPartitions=2).collect()
    work = Path(tempfile.mkdtemp(prefix="artifact-bench-hosts-", dir=os.environ.get("BENCH_DIR")))
    source = "/tmp/hvdtb-bench-source.bin"
    bed.run(worker, ["dd", "if=/dev/urandom", "of=%s" % source, "bs=1M", "count=%d" % args.mib, "status=none"],
            check=True)
    results: dict = {}
    try:
        for link in ("shaped", "unshaped"):
            if link == "shaped":
                bed.shape(worker, args.rate)
            else:
                bed.unshape(worker)
            speeds: dict[str, list[float]] = {"pull": [], "tcp": []}
            rss: list[float] = []
            for i in range(args.rounds):
                order = ("pull", "tcp") if i % 2 == 0 else ("tcp", "pull")
                for contender in order:
                    if contender == "tcp":
                        speeds["tcp"].append(tcp_transfer(bed, worker, source, work / "tcp.bin"))
                        continue
                    dest = work / ("run-%s-%d" % (link, i))
                    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest,
                                           driver_log_verbosity="log_callback_only")
                    with PeakRss() as peak:
                        runner.run(write_checkpoint, args.mib)
                    if runner.last_run.artifact_transport != "stream":
                        raise SystemExit("expected a stream from the worker host, got %s" % runner.last_run.artifact_transport)
                    speeds["pull"].append(runner.last_run.artifact_bytes / runner.last_run.artifact_transfer_s / 2**20)
                    rss.append(peak.growth_mb)
                    shutil.rmtree(dest)
                print("%s round %d: pull %.1f MiB/s, tcp %.1f MiB/s, driver RSS +%.1f MB"
                      % (link, i + 1, speeds["pull"][-1], speeds["tcp"][-1], rss[-1]), flush=True)
            results[link] = {"pull": speeds["pull"], "tcp": speeds["tcp"], "rss_mb": rss}
    finally:
        bed.unshape(worker)
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the worker host's link")
    parser.add_argument("--driver-side", nargs=3, metavar=("BED", "MASTER", "CONF"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver_side:
        bed_json, master, conf = args.driver_side
        print("RESULTS " + json.dumps(driver_side(bed_json, master, json.loads(conf), args)), flush=True)
        return

    from _common import print_load
    from tests.integration.netbed import BedCluster, NetBed

    print_load("at the start")

    why = NetBed.unavailable()
    if why:
        raise SystemExit(why)
    os.environ.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    bed = NetBed(workers=1)
    logs = Path(tempfile.mkdtemp(prefix="artifact-bench-hosts-logs-"))
    cluster = None
    try:
        bed.up()
        cluster = BedCluster(bed, logs, cores=2).start()
        env = dict(os.environ, PYTHONPATH=str(ROOT), SPARK_LOCAL_IP=bed.driver.address)
        proc = bed.popen(bed.driver, [sys.executable, __file__, "--mib", str(args.mib), "--rounds", str(args.rounds),
                                      "--rate", args.rate, "--driver-side", bed.to_json(), cluster.master,
                                      json.dumps(cluster.app_conf())],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        results = None
        for line in proc.stdout:
            if line.startswith("RESULTS "):
                results = json.loads(line[len("RESULTS "):])
            elif "round" in line:
                print(line, end="", flush=True)
        proc.wait()
        if results is None:
            raise SystemExit("the driver's side failed (exit %s); Spark logs in %s" % (proc.returncode, logs))
    finally:
        if cluster is not None:
            cluster.stop()
        bed.down()
        shutil.rmtree(logs, ignore_errors=True)
    print_load("at the end")
    print()
    print("checkpoint %d MiB, %d rounds, medians; worker link shaped to %s with tc tbf" % (args.mib, args.rounds, args.rate))
    for link in ("shaped", "unshaped"):
        pull, tcp = statistics.median(results[link]["pull"]), statistics.median(results[link]["tcp"])
        ratio = pull / tcp
        target = "  (target >= 0.9x: %s)" % ("PASS" if ratio >= 0.9 else "MISS") if link == "shaped" else ""
        print("%-9s pull %.1f MiB/s, plain TCP %.1f MiB/s, ratio %.3fx%s" % (link, pull, tcp, ratio, target))
    peak = max(results["shaped"]["rss_mb"] + results["unshaped"]["rss_mb"])
    print("driver peak RSS growth during a pull: %.1f MB  (target <= 150 MB: %s)" % (peak, "PASS" if peak <= 150 else "MISS"))


if __name__ == "__main__":
    main()
