"""Training data through the barrier stage (``dataset=``) against pyarrow reading a local file in a
bare ``horovodrun`` rank: rows of a Parquet table, 16 float32 columns, np=2 on ``local[2]``.

Run it by hand from the repository root (it is a benchmark, not a test)::

    .venv/bin/python benchmarks/dataset.py                       # 10 M rows, 3 rounds
    .venv/bin/python benchmarks/dataset.py --rows 1000000 --rounds 1
    .venv/bin/python benchmarks/dataset.py --scaling             # + 1 M vs 10 M rows, np=2 vs np=4 on a standalone cluster

The table is written once (untimed) as Parquet by Spark: ``c0..c15``, float32 values computed from
the row id. Then, alternating for ``--rounds`` rounds:

* **runner**: ``HorovodRunner(2, dataset="SELECT * FROM parquet.`<table>`").run(read)``. ``read``
  calls ``hvd.init()``, takes ``runtime.dataset()`` and reads ``--epochs`` epochs with
  ``iter_batches(--batch-size)``, turning every batch into a float32 ``[rows, 16]`` numpy matrix
  (what a training step needs). The read rate is over all epochs; the first epoch alone (every
  page of the memory map touched for the first time, costly on this VM for both contenders) is
  printed beside it. Measured: the wall time from ``run()`` to the last rank's first
  batch (the count, the shuffle into 2 partitions, the spill and the rank start), each rank's
  read rate over its epoch (rows/s), the driver's Python RSS growth and the largest RSS growth of a
  barrier task's Python worker, sampled every 50 ms while the rows move.
* **horovodrun**: ``horovodrun -np 2 --mpi`` runs the same ``read`` on the same rows, each rank
  reading its half from a local Arrow IPC file (in batches of ``--batch-size`` rows: the best layout
  pyarrow can have) through ``pyarrow.ipc.open_file`` on a memory map. The files are written,
  untimed, right before each of its runs (``--anchor-files fresh``, the default), as the runner's
  shards are spilled right before its ranks read them: the kernel writes both back to disk while
  they are read. ``--anchor-files old`` writes them once, at the start.

It prints the medians, the median of the paired ratios runner/horovodrun of the read rate
(target >= 0.9) and checks the memory targets (driver <= 50 MB, barrier task <= 200 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from _common import print_load, warm_local_session  # benchmarks/ is sys.path[0] when a script runs

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
COLUMNS = 16
READ_TARGET = 0.9
DRIVER_RSS_MB = 50
TASK_RSS_MB = 200


def read(batch_size=4096, local_file=None, epochs=1):
    """Read this rank's rows ``epochs`` times, batch by batch, as float32 matrices; return what each
    rank saw (gathered on every rank). ``local_file``: a ``%d`` path template of the rank's Arrow
    file (the horovodrun anchor); without it, ``runtime.dataset()``."""
    import time

    import horovod.torch as hvd
    import numpy
    import pyarrow as pa

    from airflow_provider_horovod import runtime

    hvd.init()
    first, checksum, rates, total = None, 0.0, [], 0.0
    for _ in range(epochs):
        started = time.perf_counter()  # imports done: from opening the file to the epoch's last batch
        if local_file is None:
            batches = runtime.dataset().iter_batches(batch_size)
        else:
            reader = pa.ipc.open_file(pa.memory_map(local_file % hvd.rank()))
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        rows = 0
        for batch in batches:
            matrix = numpy.stack([column.to_numpy() for column in batch.columns], axis=1)
            if first is None:
                first = time.time()
            rows += matrix.shape[0]
            checksum += float(matrix[0, 0])
        elapsed = time.perf_counter() - started
        rates.append(rows / elapsed)
        total += elapsed
    return hvd.allgather_object({"rank": hvd.rank(), "rows": rows, "rows_per_s": rows * epochs / total,
                                 "epoch_rates": rates, "first_batch_at": first, "checksum": checksum})


ANCHOR_SCRIPT = '''\
import json, sys

{source}

if __name__ == "__main__":
    result = read(**json.loads(sys.argv[2]))
    import horovod.torch as hvd
    if hvd.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
'''

# Writes each rank's rows (row i to rank i % np, as dataset= does) into an Arrow IPC file of
# batch-size batches: in its own process, so the driver's memory is not the anchor's.
SPLIT_SCRIPT = '''\
import sys
import numpy, pyarrow as pa, pyarrow.dataset as ds
table = ds.dataset(sys.argv[1], format="parquet").to_table()
np_, batch = int(sys.argv[3]), int(sys.argv[4])
for rank in range(np_):
    part = table.take(numpy.arange(rank, table.num_rows, np_))
    with pa.OSFile(sys.argv[2] % rank, "wb") as sink, pa.ipc.new_file(sink, part.schema) as writer:
        writer.write_table(part, max_chunksize=batch)
'''


class RssWatch:
    """Samples the driver's RSS and every Spark Python worker's RSS (the barrier tasks run there)
    every 50 ms, between ``start`` and ``stop``.

    It looks for new Python workers (a walk over every process's command line) only once a second
    and reads just the known ones' RSS in between: walking every process 20 times a second cost
    0.14 CPU-s per second on this 2-core machine, taken from the ranks whose read rate is measured."""

    SCAN_EVERY_S = 1.0

    def __init__(self) -> None:
        import psutil

        self.me = psutil.Process()
        self.driver_base = self.me.memory_info().rss
        self.workers = list(self._workers())
        self.worker_base = {p.pid: p.memory_info().rss for p in self.workers}
        self.fork_base = max(self.worker_base.values(), default=0)  # a new worker starts as a fork of the daemon
        self.driver_peak = self.driver_base
        self.worker_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _workers():
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or ())
            if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline:
                yield proc

    def _loop(self) -> None:
        import psutil

        scanned = time.monotonic()
        while not self._stop.wait(0.05):
            if time.monotonic() - scanned >= self.SCAN_EVERY_S:
                self.workers, scanned = list(self._workers()), time.monotonic()
            self.driver_peak = max(self.driver_peak, self.me.memory_info().rss)
            for proc in self.workers:
                try:
                    rss = proc.memory_info().rss
                except psutil.Error:
                    continue
                self.worker_growth = max(self.worker_growth, rss - self.worker_base.get(proc.pid, self.fork_base))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"driver_rss_growth_mb": (self.driver_peak - self.driver_base) / 2**20,
                "task_rss_growth_mb": self.worker_growth / 2**20}


def write_table(spark, rows: int, path: Path) -> None:
    from pyspark.sql import functions as F

    columns = [((F.col("id") * (i + 1)) % 1009 / F.lit(1009.0)).cast("float").alias("c%d" % i) for i in range(COLUMNS)]
    spark.range(rows, numPartitions=8).select(*columns).write.mode("overwrite").parquet(str(path))


def run_runner(spark, table: Path, np: int, batch_size: int, epochs: int = 1) -> dict:
    from airflow_provider_horovod import HorovodRunner

    runner = HorovodRunner(np, spark=spark, dataset="SELECT * FROM parquet.`%s`" % table,
                           driver_log_verbosity="log_callback_only")
    watch = RssWatch()
    started = time.time()
    ranks = runner.run(read, batch_size=batch_size, epochs=epochs)
    memory = watch.stop()
    return {"ranks": ranks, "first_batch_s": max(r["first_batch_at"] for r in ranks) - started, **memory}


def run_horovodrun(work: Path, local_file: str, np: int, batch_size: int, epochs: int = 1) -> dict:
    import inspect

    script = work / "read.py"
    script.write_text(ANCHOR_SCRIPT.format(source=textwrap.dedent(inspect.getsource(read))))
    out = work / "anchor.json"
    started = time.time()
    proc = subprocess.run([HOROVODRUN, "-np", str(np), "-H", "localhost:%d" % np, "--mpi", sys.executable, str(script),
                           str(out), json.dumps({"batch_size": batch_size, "local_file": local_file, "epochs": epochs})],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError("horovodrun exited with %d:\n%s" % (proc.returncode, proc.stdout[-3000:]))
    ranks = json.loads(out.read_text())
    return {"ranks": ranks, "first_batch_s": max(r["first_batch_at"] for r in ranks) - started}


def rate(result: dict, epoch: int | None = None) -> float:
    """The slowest rank's rows/s (the step rate every rank trains at): over every epoch, or in one."""
    return min(r["rows_per_s"] if epoch is None else r["epoch_rates"][epoch] for r in result["ranks"])


def compare(spark, rows: int, rounds: int, batch_size: int, epochs: int, work: Path, fresh: bool = True) -> bool:
    table = work / ("table-%d" % rows)
    t = time.monotonic()
    write_table(spark, rows, table)
    print("wrote %d rows x %d float32 as Parquet in %.1f s" % (rows, COLUMNS, time.monotonic() - t), flush=True)
    local_file = str(work / "shard-%d.arrow")

    def split() -> None:
        for rank in range(2):
            Path(local_file % rank).unlink(missing_ok=True)
        subprocess.run([sys.executable, "-c", SPLIT_SCRIPT, str(table), local_file, "2", str(batch_size)], check=True)

    if not fresh:
        split()  # once: every anchor run reads these
    run_runner(spark, table, 2, batch_size)  # warm-up, untimed
    runner_results, anchor_results, ratios = [], [], []
    for i in range(rounds):
        order = ("runner", "horovodrun") if i % 2 == 0 else ("horovodrun", "runner")
        got = {}
        for who in order:
            if who == "horovodrun" and fresh:
                split()  # untimed: the anchor's files are as new as the runner's spilled shards
            got[who] = run_runner(spark, table, 2, batch_size, epochs) if who == "runner" else run_horovodrun(
                work, local_file, 2, batch_size, epochs)
        assert sum(r["rows"] for r in got["runner"]["ranks"]) == rows, got["runner"]
        first = rate(got["runner"], 0) / rate(got["horovodrun"], 0)
        runner_results.append(got["runner"])
        anchor_results.append(got["horovodrun"])
        ratios.append(rate(got["runner"]) / rate(got["horovodrun"]))
        print("round %d: runner %.2fM rows/s per rank (first batch after %.1f s; driver +%.1f MB, task +%.1f MB), "
              "horovodrun %.2fM rows/s per rank: %.3fx (first epoch alone %.3fx)" % (
                  i + 1, rate(got["runner"]) / 1e6, got["runner"]["first_batch_s"],
                  got["runner"]["driver_rss_growth_mb"], got["runner"]["task_rss_growth_mb"],
                  rate(got["horovodrun"]) / 1e6, ratios[-1], first), flush=True)
    ratio = statistics.median(ratios)
    driver_mb = max(r["driver_rss_growth_mb"] for r in runner_results)
    task_mb = max(r["task_rss_growth_mb"] for r in runner_results)
    print()
    print("%d rows x %d float32, np=2, local[2], batch %d, %d epochs, %d rounds" % (rows, COLUMNS, batch_size, epochs,
                                                                                    rounds))
    print("  run() -> every rank's first batch: %.1f s (median)" % statistics.median(
        r["first_batch_s"] for r in runner_results))
    print("  read rate per rank: runner %.2fM rows/s, horovodrun + pyarrow %.2fM rows/s (medians)" % (
        statistics.median(rate(r) for r in runner_results) / 1e6, statistics.median(rate(r) for r in anchor_results) / 1e6))
    ok_rate = ratio >= READ_TARGET
    ok_driver = driver_mb <= DRIVER_RSS_MB
    ok_task = task_mb <= TASK_RSS_MB
    print("  ratio runner/horovodrun (median of paired rounds): %.3fx, target >= %.2f: %s" % (
        ratio, READ_TARGET, "PASS" if ok_rate else "MISS"))
    print("  driver RSS growth (largest): %.1f MB, target <= %d: %s" % (driver_mb, DRIVER_RSS_MB,
                                                                          "PASS" if ok_driver else "MISS"))
    print("  barrier task Python RSS growth (largest): %.1f MB, target <= %d: %s" % (
        task_mb, TASK_RSS_MB, "PASS" if ok_task else "MISS"))
    return ok_rate and ok_driver and ok_task


def scaling(spark, rows: int, batch_size: int, work: Path) -> None:
    """How the time to the first batch grows with the rows (local[2]) and with np (a standalone
    cluster of four one-core workers on this machine)."""
    small = max(rows // 10, 1000)
    print("\nscaling, time from run() to every rank's first batch (one run each after a warm-up):")
    for n in (small, rows):
        table = work / ("table-%d" % n)
        if not table.exists():
            write_table(spark, n, table)
        run_runner(spark, table, 2, batch_size)
        got = run_runner(spark, table, 2, batch_size)
        print("  local[2], np=2, %9d rows: %.1f s, %.2fM rows/s per rank" % (n, got["first_batch_s"], rate(got) / 1e6),
              flush=True)
    sys.path.insert(0, str(ROOT))
    from pyspark.sql import SparkSession

    from tests.integration.cluster import StandaloneCluster

    spark.stop()
    cluster_dir = work / "cluster"
    cluster_dir.mkdir()
    cluster = StandaloneCluster(cluster_dir, workers=4).start()
    try:
        builder = SparkSession.builder.master(cluster.master).appName("hvdrunner-dataset-scaling")
        for key, value in {**cluster.app_conf(), "spark.cores.max": "4"}.items():
            builder = builder.config(key, value)
        remote = builder.getOrCreate()
        table = work / ("table-%d" % rows)
        for np in (2, 4):
            run_runner(remote, table, np, batch_size)
            got = run_runner(remote, table, np, batch_size)
            print("  standalone (4 one-core workers), np=%d, %d rows: %.1f s, %.2fM rows/s per rank" % (
                np, rows, got["first_batch_s"], rate(got) / 1e6), flush=True)
        remote.stop()
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3, help="passes over each rank's rows (the first touches "
                                                               "every page of the memory map)")
    parser.add_argument("--scaling", action="store_true", help="also report 1/10 of the rows and np=2 vs np=4 on a "
                                                               "standalone cluster")
    parser.add_argument("--anchor-files", choices=("fresh", "old"), default="fresh",
                        help="fresh (default): the anchor's Arrow files are written again right before each of its "
                             "runs, as the runner's shards are spilled right before its ranks read them (the "
                             "kernel writes both back to disk while they are read); old: written once at the start")
    args = parser.parse_args()
    os.environ.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    print_load("at the start")
    spark = warm_local_session("hvdrunner-dataset-benchmark")
    with tempfile.TemporaryDirectory(prefix="hvd-dataset-bench-") as tmp:
        ok = compare(spark, args.rows, args.rounds, args.batch_size, args.epochs, Path(tmp),
                     fresh=args.anchor_files == "fresh")
        if args.scaling:
            scaling(spark, args.rows, args.batch_size, Path(tmp))
    print_load("at the end")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
