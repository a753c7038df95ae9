"""Launch overhead of a no-op Horovod job: bare ``horovodrun`` vs ``HorovodRunner`` vs ``TorchDistributor``.

Run it by hand from the repository root (it is a benchmark, not a test)::

    .venv/bin/python benchmarks/launch_overhead.py              # 5 rounds
    .venv/bin/python benchmarks/launch_overhead.py --rounds 9   # less noise, longer

Every contender runs the same no-op job with 2 ranks: ``hvd.init()``, one ``hvd.allreduce`` of a
1-element tensor, return (TorchDistributor: ``init_process_group("gloo")``, one ``all_reduce``,
``destroy_process_group``). The contenders are

* ``horovodrun --mpi`` and ``horovodrun --gloo``: ``horovodrun -np 2 -H localhost:2 --<launcher>
  python noop.py`` through ``subprocess`` (a script file written to a temp dir); wall time of the
  whole command;
* ``HorovodRunner(2, spark=spark).run(noop)``, with ``launcher="mpirun"`` (the default) and
  ``launcher="gloo"``, on a warm ``local[2]`` SparkSession, and ``HorovodRunner(2, launcher="torch")``
  running TorchDistributor's own job below (``torch_noop``: no Horovod imported);
* ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)`` on the same
  session (distributed mode: one barrier task per process, ``torchrun`` in each).

Each contender gets one untimed warm-up run; then ``--rounds`` rounds, each running every contender
once beside a TorchDistributor run of its own (a pair: the anchor first in one round, second in the
next; the pairs in an order shuffled anew each round), every run after the settle check
(``Settler``: what the run before left behind, its processes, the Python workers it ended, the
JVM's garbage and the load, is gone or waited out, and the wait is printed). The script prints the
median wall time of each, each pair's ratio contender / TorchDistributor and their median against
the targets (issue 34: every launcher <= 0.30x TorchDistributor; issue 51: <= 0.15x), and the runner
against ``horovodrun`` of its controller (<= 0.5x, ratio of medians), all from this one run.

It also prints where the time goes: rank 0 records wall-clock stamps as the job function starts,
after ``import torch``/``horovod``, after ``init`` and after the allreduce, so each wall splits into
*start* (until rank 0's function is entered), *import*, *init*, *op*, and *end* (from the op to
the call's return, teardown included). All stamps come from the same clock on one machine.
For HorovodRunner the run report's own phase marks (``last_run.phases``: every task's facts in
and the plan sent, start sent, every task finished and released) split *start* and *end* further.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

from _common import warm_local_session  # benchmarks/ is sys.path[0] when a script runs

NP = 2
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
TARGETS = {  # issue 34: every launcher <= 0.30x TorchDistributor; mpirun and gloo <= 0.5x horovodrun of their controller
    ("runner_mpirun", "horovodrun_mpi"): 0.5,
    ("runner_gloo", "horovodrun_gloo"): 0.5,
    ("runner_mpirun", "torchdistributor"): 0.30,
    ("runner_gloo", "torchdistributor"): 0.30,
    ("runner_torch", "torchdistributor"): 0.30,
}
TARGET_TD_51, TARGET_WALL_51 = 0.15, 1.2  # issue 51 (with warm rank processes): each launcher, pairs' median and wall


# -- the job functions (shipped by value: every import is inside) -------------------------------
def noop():
    """The no-op Horovod job: init, one 1-element allreduce, return rank 0's timestamps."""
    import time

    stamps = {"enter": time.time()}
    import horovod.torch as hvd
    import torch

    stamps["imported"] = time.time()
    hvd.init()
    stamps["init"] = time.time()
    out = hvd.allreduce(torch.ones(1), name="noop")
    stamps["op"] = time.time()
    assert out.item() == 1.0, out  # Average of ones
    stamps["size"] = hvd.size()
    return stamps


def torch_noop():
    """The same job in plain torch.distributed, for TorchDistributor (env set by torchrun)."""
    import time

    stamps = {"enter": time.time()}
    import torch
    import torch.distributed as dist

    stamps["imported"] = time.time()
    dist.init_process_group("gloo")
    stamps["init"] = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    stamps["op"] = time.time()
    assert t.item() == float(dist.get_world_size()), t
    stamps["size"] = dist.get_world_size()
    dist.destroy_process_group()
    return stamps


SCRIPT = '''\
import json, sys


{source}

if __name__ == "__main__":
    stamps = noop()
    import horovod.torch as hvd
    if hvd.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(stamps, f)
'''


# -- HorovodRunner's own phase marks (RunReport.phases: seconds after run() began) ------------------
PHASES: list[dict[str, float]] = []


def runner_start_split(phases: dict[str, float], t0: float, enter: float) -> dict:
    """Seconds from run() to: every task's facts in (the plan goes out), start sent, rank 0's fn entered."""
    out = {label: phases[key] for key, label in (("facts", "plan sent"), ("start", "start sent")) if key in phases}
    out["fn entered"] = enter - t0
    if "released" in phases:
        out["tasks released"] = phases["released"]
    return out


# -- contenders ---------------------------------------------------------------------------------
class Contenders:
    def __init__(self, spark, workdir: Path) -> None:
        self.spark = spark
        self.workdir = workdir
        self.settler = Settler()
        self.script = workdir / "noop.py"
        self.script.write_text(SCRIPT.format(source=textwrap.dedent(inspect.getsource(noop))))

    def horovodrun(self, launcher: str) -> dict:
        out = self.workdir / "stamps.json"
        out.unlink(missing_ok=True)
        cmd = [HOROVODRUN, "-np", str(NP), "-H", "localhost:%d" % NP, "--%s" % launcher, sys.executable, str(self.script),
               str(out)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError("horovodrun exited with %d:\n%s" % (proc.returncode, proc.stdout[-3000:]))
        return json.loads(out.read_text())

    def horovodrun_mpi(self) -> dict:
        return self.horovodrun("mpi")

    def horovodrun_gloo(self) -> dict:
        return self.horovodrun("gloo")

    def runner(self, launcher: str) -> dict:
        from airflow_provider_horovod import HorovodRunner

        runner = HorovodRunner(NP, launcher=launcher, spark=self.spark, driver_log_verbosity="log_callback_only")
        try:
            return runner.run(torch_noop if launcher == "torch" else noop)
        finally:
            PHASES.append(dict(runner.last_run.phases))

    def runner_mpirun(self) -> dict:
        return self.runner("mpirun")

    def runner_gloo(self) -> dict:
        return self.runner("gloo")

    def runner_torch(self) -> dict:
        return self.runner("torch")

    def settle(self) -> dict:
        """Between two contenders, untimed, and measured: what the previous contender left behind is
        gone (or waited out) before the next starts (``Settler``); what it waited for."""
        return self.settler.settle(self.spark)

    def torchdistributor(self) -> dict:
        from pyspark.ml.torch.distributor import TorchDistributor

        return TorchDistributor(num_processes=NP, local_mode=False, use_gpu=False).run(torch_noop)


# -- settling between contenders ----------------------------------------------------------------
LAUNCH_PROCESSES = ("torchrun", "torch.distributed.run", "mpirun", "orterun", "orted", "horovodrun", "hvdrunner",
                    "horovod.runner", "noop.py", "airflow_provider_horovod.runner")
# this script; the runner's janitors (asleep until their process ends); an executor's warm rank process
# (asleep until a rank asks for a fork; it ends with its executor, the pyspark daemon)
IDLE_PROCESSES = ("launch_overhead.py", "--janitor", "airflow_provider_horovod.runner.rank.warm")
QUIET_BUSY = 0.15  # settled when this benchmark's process tree uses under this many cores ...
QUIET_WINDOW_S = 0.25  # ... over two windows of this length in a row
SETTLE_MAX_S = 30.0


class Settler:
    """The settle check between contenders (issue 51 item 2). Each contender leaves something
    behind: TorchDistributor's barrier tasks end their Spark Python workers (the next job pays for
    new ones) and leave ``torchrun`` and its ranks exiting, a JVM with a burst of garbage, sockets in
    TIME_WAIT, and load; the runner leaves its ranks and the task's shipper exiting; ``horovodrun``
    leaves its ranks and ``mpirun``/``orted``. Before the next contender starts, ``settle``:

    1. runs a small Python job on the session, so every contender starts on warm Python workers
       whatever ran before it (after TorchDistributor the next Spark job paid ~0.3-1.7 s for new
       ones), and asks the JVM for a full GC (``System.gc()``), so no contender pays for the
       previous one's garbage;
    2. waits until no process of a launch is left on the machine (``LAUNCH_PROCESSES`` in its
       command line, started after this benchmark: ``torchrun``, ranks, ``mpirun``, ``orted``);
    3. waits until what this benchmark runs is quiet: its process tree (the JVM, the Python workers,
       anything a contender left in it) under ``QUIET_BUSY`` cores over two ``QUIET_WINDOW_S``
       windows in a row, which is what the load average says a minute late. The whole machine's
       busy share (``/proc/stat``) is printed beside it: other users' work is not waited for.

    It gives up after ``SETTLE_MAX_S`` (the contender then runs unsettled, and the report counts
    it). It does not wait for TIME_WAIT sockets (60 s each on Linux; the contenders use ephemeral
    ports, so they cost nothing but a table entry): their count and the JVM's thread count are
    printed beside each settle, so a trend would show."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.since = time.time()
        self.me = os.getpid()
        self.log: list[dict] = []

    def leftovers(self) -> list[str]:
        found = []
        for proc in self.psutil.process_iter(["pid", "cmdline", "create_time"]):
            info = proc.info
            if info["pid"] == self.me or not info["cmdline"] or (info["create_time"] or 0) < self.since:
                continue
            line = " ".join(info["cmdline"])
            if any(word in line for word in LAUNCH_PROCESSES) and not any(word in line for word in IDLE_PROCESSES):
                found.append("%d %s" % (info["pid"], line[:80]))
        return found

    @staticmethod
    def _cpu() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def _tree_cpu(self) -> float:
        total = 0.0
        me = self.psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(self.psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
        return total

    def busy(self, seconds: float) -> tuple[float, float]:
        """CPU busy over ``seconds``: this benchmark's own process tree (the JVM, its Python workers,
        anything a contender left), in cores; and the whole machine, as a share of its CPUs."""
        b0, t0, c0 = *self._cpu(), self._tree_cpu()
        time.sleep(seconds)
        b1, t1, c1 = *self._cpu(), self._tree_cpu()
        return (c1 - c0) / seconds, (b1 - b0) / max(1, t1 - t0)

    def time_waits(self) -> int:
        count = 0
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(name) as f:
                count += sum(1 for line in f.readlines()[1:] if line.split()[3] == "06")
        return count

    def jvm_threads(self, spark) -> int | None:
        with contextlib.suppress(Exception):
            pid = int(spark._jvm.ProcessHandle.current().pid())
            return self.psutil.Process(pid).num_threads()
        return None

    def settle(self, spark) -> dict:
        t0 = time.monotonic()
        spark.sparkContext.parallelize(range(2 * NP), NP).map(lambda x: x).count()
        spark._jvm.System.gc()
        left, quiet, busy, machine = self.leftovers(), 0, 1.0, 1.0
        while time.monotonic() - t0 < SETTLE_MAX_S:
            if left:
                time.sleep(0.1)
                left = self.leftovers()
                continue
            busy, machine = self.busy(QUIET_WINDOW_S)
            quiet = quiet + 1 if busy < QUIET_BUSY else 0
            if quiet >= 2:
                break
            left = self.leftovers()
        done = {"waited": time.monotonic() - t0, "settled": not left and quiet >= 2, "busy": busy, "machine": machine,
                "left": left[:3], "time_wait": self.time_waits(), "jvm_threads": self.jvm_threads(spark)}
        self.log.append(done)
        return done


NAMES = {
    "horovodrun_mpi": "horovodrun -np 2 --mpi (subprocess)",
    "horovodrun_gloo": "horovodrun -np 2 --gloo (subprocess)",
    "runner_mpirun": "HorovodRunner(2) mpirun",
    "runner_gloo": "HorovodRunner(2) gloo",
    "runner_torch": "HorovodRunner(2) torch",
    "torchdistributor": "TorchDistributor(2, local_mode=False)",
}


def timed(fn) -> tuple[float, dict | None, str | None]:
    PHASES.clear()
    t0 = time.time()
    try:
        stamps = fn()
    except Exception as err:  # noqa: BLE001 - a misbehaving contender is reported, not hidden
        if type(err).__name__ == "RunCancelledError":  # our own SIGTERM/Ctrl-C, turned into a cancel by the runner
            raise KeyboardInterrupt from err
        return time.time() - t0, None, "%s: %s" % (type(err).__name__, str(err).strip().splitlines()[0][:300] if str(err).strip() else "")
    t1 = time.time()
    if not isinstance(stamps, dict) or stamps.get("size") != NP:
        return t1 - t0, None, "unexpected return value %r" % (stamps,)
    split = {
        "start": stamps["enter"] - t0,
        "import": stamps["imported"] - stamps["enter"],
        "init": stamps["init"] - stamps["imported"],
        "op": stamps["op"] - stamps["init"],
        "end": t1 - stamps["op"],
    }
    if PHASES:
        split["runner"] = runner_start_split(PHASES[-1], t0, stamps["enter"])
    return t1 - t0, split, None


def make_spark():
    return warm_local_session("hvdrunner-launch-overhead")


def fmt_ratio(num: float | None, den: float | None) -> tuple[str, float | None]:
    if num is None or den is None:
        return "n/a", None
    return "%.2fx" % (num / den), num / den


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--skip", action="append", default=[], choices=sorted(NAMES),
                        help="leave a contender out (repeatable)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


@dataclasses.dataclass
class Rounds:
    """What the timed rounds measured, per contender; only whole rounds count."""

    order: list[str]
    walls: dict[str, list[float]]
    splits: dict[str, list[dict]]
    errors: dict[str, list[str]]
    per_round: list[dict[str, float]] = dataclasses.field(default_factory=list)
    pairs: list[dict] = dataclasses.field(default_factory=list)  # contender / TorchDistributor, side by side
    settles: list[dict] = dataclasses.field(default_factory=list)
    done: int = 0

    @classmethod
    def of(cls, order: list[str]) -> Rounds:
        return cls(order, {n: [] for n in order}, {n: [] for n in order}, {n: [] for n in order})

    def medians(self) -> dict[str, float | None]:
        return {n: statistics.median(w) if w else None for n, w in self.walls.items()}


def main() -> int:
    args = parse_args()
    # Docker-friendly shared memory for Open MPI, as the test suite uses; applies to both MPI contenders.
    os.environ.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")

    signal.signal(signal.SIGTERM, _interrupt)  # a timeout still gets the summary of the rounds so far
    t_setup = time.time()
    spark = make_spark()
    print("SparkSession local[2] up in %.1fs; Python %s; %d CPUs; load average %.2f %.2f %.2f"
          % ((time.time() - t_setup, sys.version.split()[0], os.cpu_count()) + os.getloadavg()))
    rounds = Rounds.of([n for n in NAMES if n not in args.skip])
    with tempfile.TemporaryDirectory(prefix="hvd-launch-bench-") as tmp:
        c = Contenders(spark, Path(tmp))
        warm_up(c, rounds.order)
        try:
            for r in range(args.rounds):
                run_round(c, rounds, r, args.rounds)
        except KeyboardInterrupt:
            print("interrupted in round %d: the summary below covers the %d whole rounds before it" % (rounds.done + 1, rounds.done))
    print("load average at the end: %.2f %.2f %.2f (other work on the machine skews every number)" % os.getloadavg())
    report_walls(rounds)
    report_ratios(rounds)
    spark.stop()
    return 0


def warm_up(c: Contenders, order: list[str]) -> None:
    print("warm-up (untimed):")
    for name in order:
        wall, _, err = timed(getattr(c, name))
        print("  %-40s %6.2fs%s" % (NAMES[name], wall, "  FAILED: " + err if err else ""), flush=True)


ANCHOR = "torchdistributor"


def run_round(c: Contenders, rounds: Rounds, r: int, total: int) -> None:
    """Round ``r``: every contender once, each paired with a TorchDistributor run beside it (the
    anchor), in an order shuffled anew each round (seeded by the round). Within a contender's pair
    the anchor goes first in one round and second in the next (and half the contenders start each
    way), so no contender always follows TorchDistributor; each pair's ratio is contender / anchor, both measured
    a few seconds apart. Every run starts after the settle check (``Settler``). Without the anchor
    (``--skip torchdistributor``), the contenders simply run once each."""
    others = [n for n in rounds.order if n != ANCHOR]
    random.Random(r).shuffle(others)
    paired = ANCHOR in rounds.order
    line, got, pairs = [], [], []
    for name in others if others else [ANCHOR]:
        seq = [name]
        if paired and name != ANCHOR:
            seq = [ANCHOR, name] if (r + rounds.order.index(name)) % 2 == 0 else [name, ANCHOR]
        walls = {}
        for who in seq:
            settled = c.settle()
            wall, split, err = timed(getattr(c, who))
            rounds.settles.append(settled)
            if err:
                rounds.errors[who].append(err)
                line.append("%s FAILED" % who)
                print("    %s failed in round %d: %s" % (NAMES[who], r + 1, err))
                continue
            walls[who] = wall
            got.append((who, wall, split))
            line.append("%s %.2fs%s" % (who, wall, "" if settled["settled"] else " (unsettled)"))
        if paired and name != ANCHOR and len(walls) == 2:
            pairs.append({"name": name, "first": seq[0], "ratio": walls[name] / walls[ANCHOR],
                          "wall": walls[name], "anchor": walls[ANCHOR]})
    for name, wall, split in got:
        rounds.walls[name].append(wall)
        rounds.splits[name].append(split)
    rounds.pairs.extend(pairs)
    rounds.per_round.append({name: statistics.median(w for n, w, _ in got if n == name) for name in {n for n, _, _ in got}})
    rounds.done += 1
    print("round %d/%d: %s" % (r + 1, total, ", ".join(line)), flush=True)
    for pair in pairs:
        print("    pair %-16s / torchdistributor = %.2fs / %.2fs = %.3fx  (%s first)" % (
            pair["name"], pair["wall"], pair["anchor"], pair["ratio"],
            "anchor" if pair["first"] == ANCHOR else "contender"), flush=True)


def report_walls(rounds: Rounds) -> None:
    med = rounds.medians()
    print()
    print("Median wall time of a no-op np=2 job over %d rounds (warm SparkSession, local[2])" % rounds.done)
    print("%-40s %8s %8s %8s   %s" % ("contender", "median", "min", "max", "median split: start / import / init / op / end"))
    for name in rounds.order:
        walls, errors, splits = rounds.walls[name], rounds.errors[name], rounds.splits[name]
        if not walls:
            why = "%d runs failed, first: %s" % (len(errors), errors[0]) if errors else "no whole round"
            print("%-40s %8s   %s" % (NAMES[name], "-", why))
            continue
        parts = " / ".join("%s %.2f" % (k, statistics.median(s[k] for s in splits)) for k in ("start", "import", "init", "op", "end"))
        fails = "  (%d failed runs)" % len(errors) if errors else ""
        print("%-40s %7.2fs %7.2fs %7.2fs   %s%s" % (NAMES[name], med[name], min(walls), max(walls), parts, fails))
    for name in rounds.order:
        marks = [s["runner"] for s in rounds.splits[name] if "runner" in s]
        if marks:
            keys = [k for k in marks[0] if all(k in m for m in marks)]
            print("  %s start, median seconds after run(): %s" % (
                NAMES[name], ", ".join("%s %.2f" % (k, statistics.median(m[k] for m in marks)) for k in keys)))


def report_ratios(rounds: Rounds) -> None:
    med = rounds.medians()
    print()
    print("%-46s %8s %8s  %-6s %s" % ("ratio", "measured", "target", "result", "how"))
    for (runner, other), target in TARGETS.items():
        if runner not in rounds.order or other not in rounds.order:
            continue
        if other == ANCHOR:  # the pairs: each contender run beside its own TorchDistributor run
            ratios = [p["ratio"] for p in rounds.pairs if p["name"] == runner]
            value = statistics.median(ratios) if ratios else None
            how = "median of %d pairs: %s" % (len(ratios), " ".join("%.3f" % x for x in ratios))
        else:
            _, value = fmt_ratio(med[runner], med[other])
            how = "ratio of medians; per round %s" % " ".join(
                "%.3f" % (w[runner] / w[other]) for w in rounds.per_round if runner in w and other in w)
        text = "n/a" if value is None else "%.3fx" % value
        verdict = "n/a (a contender failed)" if value is None else ("PASS" if value <= target else "MISS")
        print("%-46s %8s %8s  %-6s %s" % ("%s / %s" % (runner, other), text, "<= %.2fx" % target, verdict, how))
    for name in rounds.order:
        if name == ANCHOR:
            continue
        ratios = [p["ratio"] for p in rounds.pairs if p["name"] == name]
        after = [p["ratio"] for p in rounds.pairs if p["name"] == name and p["first"] == ANCHOR]
        before = [p["ratio"] for p in rounds.pairs if p["name"] == name and p["first"] != ANCHOR]
        if ratios:
            print("  %-16s / torchdistributor, pairs: median %.3fx; after the anchor %s, before it %s" % (
                name, statistics.median(ratios), " ".join("%.3f" % x for x in after) or "-",
                " ".join("%.3f" % x for x in before) or "-"))
        if name.startswith("runner_") and ratios and rounds.walls[name]:
            wall = statistics.median(rounds.walls[name])
            print("  %-16s issue 51 targets: <= %.2fx TorchDistributor (%.3fx: %s), <= %.1f s (%.2f s: %s)" % (
                name, TARGET_TD_51, statistics.median(ratios), "PASS" if statistics.median(ratios) <= TARGET_TD_51
                else "MISS", TARGET_WALL_51, wall, "PASS" if wall <= TARGET_WALL_51 else "MISS"))
    s_ = rounds.settles
    if s_:
        waits = [x["waited"] for x in s_]
        print("settle checks: %d, %d unsettled after %.0f s; wait median %.2f s, max %.2f s; TIME_WAIT sockets %d-%d; "
              "JVM threads %s; machine busy at the start of a run, median %.0f%%" % (
                  len(s_), sum(1 for x in s_ if not x["settled"]), SETTLE_MAX_S, statistics.median(waits),
                  max(waits), min(x["time_wait"] for x in s_), max(x["time_wait"] for x in s_),
                  "%s-%s" % (min(x["jvm_threads"] or 0 for x in s_), max(x["jvm_threads"] or 0 for x in s_)),
                  100 * statistics.median(x["machine"] for x in s_)))
        for x in s_:
            if not x["settled"]:
                print("  unsettled: tree busy %.2f cores, left %s" % (x["busy"], x["left"]))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
