"""Pull a checkpoint from a worker host over a shaped link; compare with plain TCP over that link.

    .venv/bin/python benchmarks/artifact_transfer_hosts.py [--mib 1024] [--rounds 3] [--rate 1gbit]

Needs root: it builds the multi-host test bed (``tests/integration/netbed.py``): a driver host and
one worker host in network namespaces on a bridge, the worker's link shaped with ``tc tbf`` to
``--rate``, a Spark standalone master on the driver host and a worker (2 cores) on the worker host.
The driver's side runs inside the driver's namespace. Each round, in alternating order:

- ``pull``: ``HorovodRunner(2)`` on the worker host; rank 0 writes a ``--mib`` checkpoint into
  ``runtime.checkpoint_dir()`` (its host's own /tmp, which the driver cannot see), and the runner
  streams it to ``artifact_dir`` on the driver. Time: the driver's own (offer to last byte written).
  CPU: the driver process's, over the whole run (Spark's driver threads included). Rank 0 first
  commits a one-file version (``runtime.commit_checkpoint``), so its rename ships no version and the
  final hand-over alone carries the checkpoint; ``--durable`` leaves the rename to ship it as a
  version as well (then the driver lands the checkpoint twice, and the hand-over's figure shows it).
- ``stream``: the same stream without Spark: ``transfer.send_tree`` in a process on the worker
  host to ``transfer.receive_tree`` in a thread of the driver's process, over ``wire``'s
  authenticated, encrypted connection (AES-256-GCM, issue 40). CPU: the sending process's and the
  receiving thread's own.
- ``tcp``: the same number of bytes, from a file on the worker host's /tmp, sent with
  ``socket.sendfile`` over one TCP connection to the driver, which writes it to a file in the same
  folder as the pull's: the link's and the disk's speed, with no framing, MAC or protocol. CPU as
  for ``stream``.

Then, still on the shaped link, ``--version-runs`` trainings as in ``checkpoint_commit.py``
(``HorovodRunner(2, artifact_dir=...)`` on the worker host; rank 0 writes a ``--version-mib``
checkpoint every 4 s for 16 s, each shipped as a version while training goes on): each committed
version's latency from rank 0's rename to its commit on the driver (the hosts are namespaces of one
kernel: one clock). Then the pull rounds with the link unshaped.

Targets (issue 20; issue 40 for the encrypted pull): pull >= 0.95x tcp shaped and >= 0.7x tcp
unshaped; driver RSS growth (peak during a pull, sampled every 10 ms) <= 150 MB; commit latency across hosts <= ``--version-mib``
/ the link's rate (plain TCP's, measured) + 2 s. CPU seconds are per transfer of ``--mib`` MiB
(kernel time spent on a process's behalf included).

Every contender starts after a ``sync`` and ``--settle`` seconds of quiet (5 by default), so each
writes into memory the VM has not touched lately, as a pull always does (rank 0 has just written its
checkpoint; see docs/benchmarks.md, "Why every contender waits 10 s first"); ``--settle 0``
lets plain TCP and the bare stream write into pages the contender before them has just freed.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import resource, socket, sys
addr, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
with socket.create_connection((addr, port)) as s, open(path, 'rb') as f:
    began = cpu()
    s.sendfile(f)
print(cpu() - began)
"""

STREAM_SENDER = """
import os, resource, sys
from pathlib import Path
from airflow_provider_horovod.runner import transfer, wire
addr, port, secret, path = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
tree = Path(path + '.tree')
tree.mkdir(exist_ok=True)
if not (tree / 'model.bin').exists():
    os.link(path, tree / 'model.bin')
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
conn = wire.connect((addr, port), wire.Credentials.of(secret, wire.ROLE_TASK))
began = cpu()
transfer.send_tree(conn, tree)
conn.close()
print(cpu() - began)
"""


@dataclasses.dataclass
class Transfer:
    """One contender's transfer: MiB/s, and CPU seconds of the sending and the receiving side."""

    speed: float
    send_cpu: float | None
    recv_cpu: float


def _from_worker(bed, worker, script: str, args: list[str], receive) -> Transfer:
    """Run ``script`` on the worker host against a listener on the driver, ``receive(sock)`` in a
    thread here (returning the bytes it took); time and CPU of both sides."""
    listener = socket.socket()
    listener.bind((bed.driver.address, 0))
    listener.listen(1)
    got: dict[str, float] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            began, cpu = time.monotonic(), time.thread_time()
            size = receive(conn)
            got["speed"] = size / (time.monotonic() - began) / 2**20
            got["cpu"] = time.thread_time() - cpu

    thread = threading.Thread(target=serve)
    thread.start()
    sender = bed.run(worker, [sys.executable, "-c", script, bed.driver.address, str(listener.getsockname()[1]), *args],
                     check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    thread.join()
    listener.close()
    return Transfer(got["speed"], float(sender.stdout.split()[-1]), got["cpu"])


def tcp_transfer(bed, worker, source: str, dest: Path) -> Transfer:
    """One plain TCP transfer of ``source`` (on the worker host) into ``dest`` (on the driver)."""

    def receive(conn: socket.socket) -> int:
        size = 0
        with open(dest, "wb") as out:
            view = memoryview(bytearray(4 << 20))
            while n := conn.recv_into(view):
                out.write(view[:n])
                size += n
        return size

    try:
        return _from_worker(bed, worker, SENDER, [source], receive)
    finally:
        os.remove(dest)


def stream_transfer(bed, worker, source: str, dest: Path) -> Transfer:
    """``source`` as a one-file tree over the authenticated stream, without Spark."""
    from airflow_provider_horovod.runner import transfer, wire

    secret = wire.new_secret()

    def receive(sock: socket.socket) -> int:
        conn = wire.handshake(sock, wire.server_keys(secret, wire.ROLE_TASK))
        return sum(f["size"] for f in transfer.receive_tree(conn, dest))

    try:
        return _from_worker(bed, worker, STREAM_SENDER, [secret.hex(), source], receive)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def driver_side(bed_json: str, master: str, conf: dict, args) -> dict:
    """Runs in the driver's namespace: the rounds, shaped then unshaped."""
    import psutil
    from _common import write_checkpoint
    from artifact_transfer import PeakRss
    from pyspark.sql import SparkSession

    from airflow_provider_horovod import HorovodRunner
    from tests.integration.netbed import NetBed

    bed = NetBed.from_json(bed_json)
    worker = bed.workers[0]
    driver = psutil.Process()
    builder = SparkSession.builder.master(master).appName("artifact-transfer-hosts")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(4, numPartitions=2).collect()
    from checkpoint_commit import latencies, train

    work = Path(tempfile.mkdtemp(prefix="artifact-bench-hosts-", dir=os.environ.get("BENCH_DIR")))
    source = "/tmp/hvdtb-bench-source.bin"
    bed.run(worker, ["dd", "if=/dev/urandom", "of=%s" % source, "bs=1M", "count=%d" % args.mib, "status=none"],
            check=True)
    results: dict = {}
    try:
        for link in args.links:
            if link == "shaped":
                bed.shape(worker, args.rate)
            else:
                bed.unshape(worker)
            runs: dict[str, list[Transfer]] = {"pull": [], "stream": [], "tcp": []}
            rss: list[float] = []
            for i in range(args.rounds):
                order = ("pull", "stream", "tcp")[i % 3:] + ("pull", "stream", "tcp")[:i % 3]
                for contender in order:
                    os.sync()
                    time.sleep(args.settle)  # memory freed by the contender before goes back to the host (see --settle)
                    if contender == "tcp":
                        runs["tcp"].append(tcp_transfer(bed, worker, source, work / "tcp.bin"))
                        continue
                    if contender == "stream":
                        runs["stream"].append(stream_transfer(bed, worker, source, work / "stream"))
                        continue
                    dest = work / ("run-%s-%d" % (link, i))
                    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest,
                                           driver_log_verbosity="log_callback_only")
                    cpu = sum(driver.cpu_times()[:2])
                    with PeakRss() as peak:
                        runner.run(write_checkpoint, args.mib, versions=args.durable)
                    if runner.last_run.artifact_transport != "stream":
                        raise SystemExit("expected a stream from the worker host, got %s" % runner.last_run.artifact_transport)
                    versions = len(runner.last_run.checkpoints)
                    runs["pull"].append(Transfer(runner.last_run.artifact_bytes / runner.last_run.artifact_transfer_s / 2**20,
                                                 None, sum(driver.cpu_times()[:2]) - cpu))
                    rss.append(peak.growth_mb)
                    shutil.rmtree(dest)
                print("%s round %d: pull %.1f MiB/s (driver CPU %.2f s), stream %.1f MiB/s (CPU send %.2f s, receive "
                      "%.2f s), tcp %.1f MiB/s (CPU send %.2f s, receive %.2f s), driver RSS +%.1f MB, versions %d, load %.2f"
                      % (link, i + 1, runs["pull"][-1].speed, runs["pull"][-1].recv_cpu, runs["stream"][-1].speed,
                         runs["stream"][-1].send_cpu, runs["stream"][-1].recv_cpu, runs["tcp"][-1].speed,
                         runs["tcp"][-1].send_cpu, runs["tcp"][-1].recv_cpu, rss[-1], versions, os.getloadavg()[0]), flush=True)
            results[link] = {name: [dataclasses.asdict(t) for t in done] for name, done in runs.items()}
            results[link]["rss_mb"] = rss
            if link == "shaped":
                results["latency"] = []
                for i in range(args.version_runs):
                    dest = work / ("versions-%d" % i)
                    runner = HorovodRunner(2, launcher="gloo", spark=spark, artifact_dir=dest,
                                           driver_log_verbosity="log_callback_only")
                    got = runner.run(train, seconds=16.0, every=4.0, mib=args.version_mib)
                    lat = latencies(got, runner.last_run.checkpoints)
                    results["latency"] += lat
                    shutil.rmtree(dest)
                    print("shaped versions run %d: %d versions of %d MiB committed, latency %s s, load %.2f"
                          % (i + 1, len(lat), args.version_mib, " ".join("%.2f" % x for x in lat), os.getloadavg()[0]),
                          flush=True)
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
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds of quiet after a sync before each contender: on VMs that hand freed memory back "
                             "to the host, every contender then writes into fresh memory, as a pull does after its "
                             "job started (docs/benchmarks.md); 0: plain TCP and the bare stream write into pages the "
                             "contender before them has just freed")
    parser.add_argument("--version-runs", type=int, default=2,
                        help="trainings on the shaped link that ship a checkpoint version every 4 s (commit latency)")
    parser.add_argument("--version-mib", type=int, default=100, help="size of each of those checkpoints")
    parser.add_argument("--durable", action="store_true",
                        help="let rank 0's rename ship the checkpoint as a version during the run too (the default "
                             "commits an empty version first, so only the final hand-over carries it)")
    parser.add_argument("--links", nargs="+", choices=("shaped", "unshaped"), default=["shaped", "unshaped"],
                        help="which links to measure, in this order (the encryption's target is on the unshaped one)")
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
        options = ["--mib", str(args.mib), "--rounds", str(args.rounds), "--rate", args.rate, "--settle", str(args.settle),
                   "--version-runs", str(args.version_runs), "--links", *args.links, "--version-mib", str(args.version_mib),
                   *(["--durable"] if args.durable else [])]
        proc = bed.popen(bed.driver, [sys.executable, __file__, *options, "--driver-side", bed.to_json(), cluster.master,
                                      json.dumps(cluster.app_conf())],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        results = None
        said: list[str] = []
        for line in proc.stdout:
            if line.startswith("RESULTS "):
                results = json.loads(line[len("RESULTS "):])
            elif "round" in line or "versions run" in line:
                print(line, end="", flush=True)
            said = (said + [line])[-40:]
        proc.wait()
        if results is None:
            raise SystemExit("the driver's side failed (exit %s); Spark logs in %s; its last words:\n%s"
                             % (proc.returncode, logs, "".join(said)))
    finally:
        if cluster is not None:
            cluster.stop()
        bed.down()
        shutil.rmtree(logs, ignore_errors=True)
    print_load("at the end")
    print()
    print("checkpoint %d MiB, %d rounds, medians; worker link shaped to %s with tc tbf" % (args.mib, args.rounds, args.rate))
    for link, goal in (("shaped", 0.95), ("unshaped", 0.7)):
        if link not in results:
            continue
        med = {name: {key: statistics.median(t[key] for t in results[link][name]) if results[link][name][0][key] is not None
                      else None for key in ("speed", "send_cpu", "recv_cpu")} for name in ("pull", "stream", "tcp")}
        ratio = med["pull"]["speed"] / med["tcp"]["speed"]
        print("%-9s pull %.1f MiB/s, plain TCP %.1f MiB/s, ratio %.3fx  (target >= %.2fx: %s)"
              % (link, med["pull"]["speed"], med["tcp"]["speed"], ratio, goal, "PASS" if ratio >= goal else "MISS"))
        print("%-9s stream without Spark %.1f MiB/s (%.3fx plain TCP)" % ("", med["stream"]["speed"],
                                                                     med["stream"]["speed"] / med["tcp"]["speed"]))
        print("%-9s CPU seconds per transfer: stream send %.2f / receive %.2f, plain TCP send %.2f / receive %.2f, "
              "driver process during a pull %.2f" % ("", med["stream"]["send_cpu"], med["stream"]["recv_cpu"],
                                                      med["tcp"]["send_cpu"], med["tcp"]["recv_cpu"], med["pull"]["recv_cpu"]))
    if results.get("latency"):
        tcp_shaped = statistics.median(t["speed"] for t in results["shaped"]["tcp"])
        bound = args.version_mib / tcp_shaped + 2
        worst = max(results["latency"])
        print("commit latency across hosts, %d versions of %d MiB: median %.2f s, largest %.2f s  (target <= %d MiB / "
              "%.1f MiB/s + 2 s = %.2f s: %s)" % (len(results["latency"]), args.version_mib,
                                                  statistics.median(results["latency"]), worst, args.version_mib,
                                                  tcp_shaped, bound, "PASS" if worst <= bound else "MISS"))
    elif args.version_runs:
        print("commit latency across hosts: no version was committed during the trainings (MISS)")
    peak = max(mb for link in args.links for mb in results[link]["rss_mb"])
    print("driver peak RSS growth during a pull: %.1f MB  (target <= 150 MB: %s)" % (peak, "PASS" if peak <= 150 else "MISS"))


if __name__ == "__main__":
    main()
