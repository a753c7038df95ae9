"""Training throughput under ``HorovodRunner`` vs bare ``horovodrun`` (or ``torchrun``): images/s per rank, np=2, CPU.

Run it by hand from the repository root (it is a benchmark, not a test)::

    .venv/bin/python benchmarks/throughput.py                    # mpirun, 5 rounds
    .venv/bin/python benchmarks/throughput.py --launcher gloo
    .venv/bin/python benchmarks/throughput.py --rounds 5 --steps 200
    .venv/bin/python benchmarks/throughput.py --mode report      # runtime.report every step vs none

Both contenders run the same function, ``train``: a small CNN (2 conv layers, 1x28x28 inputs,
10 classes) on synthetic images generated in the rank from a fixed seed, batch 32, SGD wrapped in
``hvd.DistributedOptimizer``, parameters and optimizer state broadcast from rank 0. Each rank does
``--warmup`` untimed steps, then times ``--steps`` steps with ``time.perf_counter`` inside the rank
and reports images/second. ``torch.set_num_threads(1)`` in every rank, so the 2 ranks do not
oversubscribe 2 cores. The contenders are

* ``horovodrun -np 2 -H localhost:2 --mpi|--gloo python train.py`` (a script file written to a temp
  dir, holding the same ``train`` source), with the same launcher as the runner;
* ``HorovodRunner(2, spark=spark).run(train, ...)`` on a warm ``local[2]`` SparkSession, with the
  default launcher (mpirun); ``--launcher gloo`` for the other one.

``--launcher torch`` runs ``train_ddp`` (the same CNN and data in ``DistributedDataParallel``, no Horovod)
under ``HorovodRunner(2, launcher="torch")`` against ``torchrun --standalone --nproc-per-node 2`` of the same
function (target >= 0.98, issue 34)::

    .venv/bin/python benchmarks/throughput.py --launcher torch --rounds 5

They alternate for ``--rounds`` rounds (after one untimed warm-up run each); the script prints the
median per-rank images/s of each and the ratio runner/horovodrun against the target (>= 0.98).

``--report`` makes the runner's ranks call ``runtime.report(step, total_steps, loss=...)`` at every step
against bare horovodrun (which has no such call): the whole rank side, as users run it.

``--mode report`` compares the runner with itself instead: ``runtime.report(step, total_steps,
loss=...)`` called on every rank at every step against the same run without it (target >= 0.99).

``--mode stall`` compares the runner with itself: the stall rule armed (every rank's stall watch samples
its main thread's stack and beats, the default) against the same run with it off (``env=
{"HVDRUNNER_STALL_WATCH": "0"}``), in paired rounds, for any ``--launcher`` (target >= 0.99, issue 37);
it also prints the watch thread's own CPU time as a share of the timed steps::

    .venv/bin/python benchmarks/throughput.py --mode stall --launcher torch --rounds 5 --steps 400

``--mode interleaved`` measures the same cost inside each run: the timed steps alternate in blocks
of ``--block`` steps between reporting at every step and not, each block timed on its own, so the
machine's drift between runs (up to 2x on this VM) cancels out; the runs alternate which kind of
block comes first. It prints the ratio with/without per run and its median (target >= 0.99)::

    .venv/bin/python benchmarks/throughput.py --mode interleaved --launcher gloo --rounds 5 --steps 400
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import print_load, warm_local_session  # benchmarks/ is sys.path[0] when a script runs

NP = 2
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
TARGET = 0.98  # issue #9: >= 0.98x horovodrun with the same launcher
WATCH_SHARES: list[float] = []  # each run's largest share of the timed steps a rank's stall watch took
LONGEST_IDLE: list[float] = []  # each run's longest stand-still of a rank's main-thread stack (stall watch)
REPORT_TARGET = 0.99  # issue #22: a runtime.report per step costs at most 1 %; issue 37: the stall watch too


def watch_reset():
    """The timed steps start: the stall watch's counters count from here."""
    from airflow_provider_horovod import runtime

    if runtime._watch is not None:
        runtime._watch.longest_idle_s = runtime._watch.busy_s = 0.0


def watch_share(elapsed):
    """Over the timed steps: the wall time this rank's stall watch spent sampling and sending (the
    most it can have taken from training: it holds the GIL meanwhile) as a share of ``elapsed``, and
    the longest its main thread's stack stood still between samples (None: no watch)."""
    from airflow_provider_horovod import runtime

    if runtime._watch is None:
        return None
    return {"share": runtime._watch.busy_s / elapsed, "longest_idle_s": runtime._watch.longest_idle_s}


def train(steps=100, warmup=10, batch_size=32, seed=1234, threads=1, report=False, block=0, report_first=False):
    """Train a small CNN on synthetic data; return every rank's images/s (gathered on all ranks).

    ``block`` > 0 interleaves: the timed steps run in blocks of ``block`` steps, every other block
    calling ``runtime.report`` at each step (the first one if ``report_first``), each block timed on
    its own; the result then also holds every rank's images/s in the blocks with and without it."""
    import time

    import horovod.torch as hvd
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    hvd.init()
    torch.manual_seed(seed + hvd.rank())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, 1)
            self.conv2 = nn.Conv2d(16, 32, 3, 1)
            self.fc1 = nn.Linear(32 * 12 * 12, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(torch.flatten(x, 1)))
            return F.log_softmax(self.fc2(x), dim=1)

    # A fixed synthetic set: 16 batches of images and labels, cycled.
    n = 16 * batch_size
    images = torch.randn(n, 1, 28, 28)
    labels = torch.randint(0, 10, (n,))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def step(i):
        lo = (i % 16) * batch_size
        optimizer.zero_grad()
        loss = F.nll_loss(model(images[lo : lo + batch_size]), labels[lo : lo + batch_size])
        loss.backward()
        optimizer.step()
        return loss

    model.train()
    for i in range(warmup):
        step(i)
    hvd.allreduce(torch.zeros(1), name="timing.start")  # start the clock together
    watch_reset()
    t0 = time.perf_counter()
    if report or block:
        from airflow_provider_horovod import runtime
    blocks = []  # (reported, seconds) of each block of `block` steps
    block_start, reporting = t0, report_first
    in_report, calls = 0.0, 0  # time spent inside runtime.report (and loss.item()), counted in interleaved runs
    for i in range(steps):
        loss = step(warmup + i)
        if report or (block and reporting):
            called = time.perf_counter()
            runtime.report(step=i + 1, total_steps=steps, loss=loss.item())
            in_report += time.perf_counter() - called
            calls += 1
        if block and (i + 1) % block == 0:
            now = time.perf_counter()
            blocks.append((reporting, now - block_start))
            block_start, reporting = now, not reporting
    elapsed = time.perf_counter() - t0
    rate = steps * batch_size / elapsed
    result = {"rates": hvd.allgather_object(rate), "size": hvd.size(), "loss": float(loss.item()), "steps": steps,
              "batch_size": batch_size, "watch": hvd.allgather_object(watch_share(elapsed))}
    if block:
        def images_per_s(reported):
            seconds = [t for r, t in blocks if r == reported]
            return len(seconds) * block * batch_size / sum(seconds)

        # each pair of neighbouring blocks, one with and one without: images/s with / without = time without / with
        pairs = [(a[1] / b[1]) if b[0] else (b[1] / a[1]) for a, b in zip(blocks[::2], blocks[1::2])]
        import threading

        import psutil

        # the CPU time of rank 0's report-sending thread (the rest of what reporting costs the rank)
        sender = next((t.native_id for t in threading.enumerate() if t.name == "hvdrunner-reports"), None)
        if hvd.rank() == 0 and sender is None:
            raise RuntimeError("rank 0 reported, yet no hvdrunner-reports thread is running")
        sender_cpu = next((t.user_time + t.system_time for t in psutil.Process().threads() if t.id == sender), 0.0)
        result["interleaved"] = hvd.allgather_object({
            "with": images_per_s(True), "without": images_per_s(False), "pairs": pairs, "in_report_s": in_report,
            "calls": calls, "sender_cpu_s": sender_cpu, "with_s": sum(t for r, t in blocks if r)})
    return result


def train_ddp(steps=100, warmup=10, batch_size=32, seed=1234, threads=1):
    """``train``'s CNN and data, written for torchrun: ``init_process_group("gloo")`` from torch's
    environment and ``DistributedDataParallel`` (no Horovod); returns every rank's images/s."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, 1)
            self.conv2 = nn.Conv2d(16, 32, 3, 1)
            self.fc1 = nn.Linear(32 * 12 * 12, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(torch.flatten(x, 1)))
            return F.log_softmax(self.fc2(x), dim=1)

    n = 16 * batch_size
    images = torch.randn(n, 1, 28, 28)
    labels = torch.randint(0, 10, (n,))
    model = DistributedDataParallel(Net())  # broadcasts rank 0's parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)

    def step(i):
        lo = (i % 16) * batch_size
        optimizer.zero_grad()
        loss = F.nll_loss(model(images[lo : lo + batch_size]), labels[lo : lo + batch_size])
        loss.backward()
        optimizer.step()
        return loss

    model.train()
    for i in range(warmup):
        step(i)
    dist.barrier()  # start the clock together
    watch_reset()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(warmup + i)
    elapsed = time.perf_counter() - t0
    rate = steps * batch_size / elapsed
    rates, shares = [None] * size, [None] * size
    dist.all_gather_object(rates, rate)
    dist.all_gather_object(shares, watch_share(elapsed))
    dist.destroy_process_group()
    return {"rates": rates, "size": size, "loss": float(loss.item()), "steps": steps, "batch_size": batch_size,
            "watch": shares}


SCRIPT_DDP = '''\
import json, os, sys


{source}

if __name__ == "__main__":
    result = train_ddp(**json.loads(sys.argv[2]))
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
'''


SCRIPT = '''\
import json, sys


{source}

if __name__ == "__main__":
    kwargs = json.loads(sys.argv[2])
    result = train(**kwargs)
    import horovod.torch as hvd
    if hvd.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
'''


def make_spark():
    return warm_local_session("hvdrunner-throughput")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--steps", type=int, default=100, help="timed training steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before the clock starts (default 10)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--launcher", choices=("mpirun", "gloo", "torch"), default="mpirun",
                        help="HorovodRunner's launcher; torch: a DDP body (train_ddp) against bare torchrun")
    parser.add_argument("--mode", choices=("horovodrun", "report", "interleaved", "stall"), default="horovodrun",
                        help="compare with bare horovodrun (default); runtime.report every step with none, as two "
                             "runs (report) or as alternating blocks of steps inside each run (interleaved)")
    parser.add_argument("--block", type=int, default=25, help="with --mode interleaved: steps per block (default 25)")
    parser.add_argument("--report", action="store_true",
                        help="with --mode horovodrun: the runner's ranks call runtime.report every step (issue #22: "
                             "everything the rank side adds, against bare horovodrun)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    if args.launcher == "torch" and (args.mode not in ("horovodrun", "stall") or args.report):
        parser.error("--launcher torch compares with bare torchrun or itself (--mode stall) only (no --mode "
                     "report/interleaved, no --report)")
    return args


def warm_up(contenders: dict, names: dict[str, str]) -> None:
    print("warm-up (untimed):")
    for name, fn in contenders.items():
        t0 = time.time()
        res = fn()
        print("  %-28s per-rank images/s %s (wall %.1fs)" % (names[name], ", ".join("%.0f" % r for r in res["rates"]), time.time() - t0),
              flush=True)


def summary(args: argparse.Namespace, names: dict[str, str], rates: dict[str, list[list[float]]], done: int) -> None:
    """The per-rank images/s of each contender over the whole rounds, and the ratio of the second to the first."""
    print()
    print("Per-rank training throughput, np=2, batch %d, %d timed steps, median over %d rounds"
          % (args.batch_size, args.steps, done))
    print("%-28s %12s %12s %16s %s" % ("contender", "rank 0", "rank 1", "mean per rank", "  (min-max of per-round means)"))
    med = {}
    for name in names:
        per_rank = [statistics.median(run[i] for run in rates[name]) for i in range(NP)]
        means = [sum(run) / NP for run in rates[name]]
        med[name] = statistics.median(means)
        print("%-28s %12.0f %12.0f %16.0f   (%.0f-%.0f)" % (names[name], per_rank[0], per_rank[1], med[name], min(means), max(means)))
    base, new = names
    ratio = med[new] / med[base]
    paired = statistics.median(sum(a) / sum(b) for a, b in zip(rates[new], rates[base]))
    target = REPORT_TARGET if args.mode in ("report", "stall") else TARGET
    print()
    print("ratio %s/%s (median per-rank images/s): %.3f   target >= %.2f   %s"
          % (new, base, ratio, target, "PASS" if ratio >= target else "MISS"))
    print("median of the per-round ratios (paired, same round):  %.3f" % paired)
    if WATCH_SHARES:
        cost = max(WATCH_SHARES)
        print("what the stall watch takes (sampling + sending, GIL held), largest rank of any run: %.4f%% of the timed "
              "steps, i.e. throughput >= %.4fx by accounting   target >= %.2f   %s"
              % (100 * cost, 1 - cost, REPORT_TARGET, "PASS" if 1 - cost >= REPORT_TARGET else "MISS"))
        print("the longest a rank's main-thread stack stood still between samples in the timed steps of any run: "
              "%.2f s" % max(LONGEST_IDLE))


def run_round(contenders: dict, rates: dict[str, list[list[float]]], r: int, total: int) -> None:
    """Round ``r``: each contender once, alternating which goes first; only whole rounds count."""
    order = list(contenders)
    line, got, results = [], {}, {}
    for name in order[r % 2 :] + order[: r % 2]:
        t0 = time.time()
        res = results[name] = contenders[name]()
        assert res["size"] == NP, res
        got[name] = res["rates"]
        line.append("%s %s img/s per rank (wall %.1fs)" % (name, "/".join("%.0f" % x for x in res["rates"]), time.time() - t0))
    for name, value in got.items():
        rates[name].append(value)
    for name in order:
        shares = [x for x in (results[name].get("watch") or []) if x is not None] if name in results else []
        if shares:
            WATCH_SHARES.append(max(x["share"] for x in shares))
            LONGEST_IDLE.append(max(x["longest_idle_s"] for x in shares))
    print("round %d/%d: %s" % (r + 1, total, "; ".join(line)), flush=True)


def interleaved(args: argparse.Namespace, spark, kwargs: dict) -> int:
    """``--mode interleaved``: in each run the timed steps alternate, block by block, between calling
    ``runtime.report`` at every step and not; the same processes, a few seconds apart, so the
    machine's drift (2x between runs here) cancels out. Runs alternate which kind of block comes first."""
    from airflow_provider_horovod import HorovodRunner

    if args.steps < 2 * args.block:
        raise SystemExit("--steps must hold at least two blocks of --block steps")

    def run(first: bool) -> dict:
        return HorovodRunner(NP, launcher=args.launcher, spark=spark, driver_log_verbosity="log_callback_only",
                             on_report=lambda _report: None).run(train, block=args.block, report_first=first, **kwargs)

    run(False)  # warm-up, untimed
    print("interleaved: %d runs of %d steps, blocks of %d steps alternating with/without runtime.report each step"
          % (args.rounds, args.steps, args.block))
    ratios, pairs, costs = [], [], []
    for r in range(args.rounds):
        got = run(r % 2 == 1)["interleaved"]
        with_, without = (sum(rank[k] for rank in got) / NP for k in ("with", "without"))
        ratios.append(with_ / without)
        pairs += [p for rank in got for p in rank["pairs"]]
        print("run %d/%d: with %.0f img/s per rank, without %.0f: %.3fx (median of its block pairs %.3f)" % (
            r + 1, args.rounds, with_, without, ratios[-1], statistics.median(got[0]["pairs"])), flush=True)
        zero = got[0]  # rank 0: the one whose reports travel
        costs.append((zero["in_report_s"] + zero["sender_cpu_s"]) / zero["with_s"])
        print("  rank 0: %d calls, %.1f us each (loss.item() included), sending thread %.3f CPU-s: %.3f%% of the "
              "with-blocks' time" % (zero["calls"], 1e6 * zero["in_report_s"] / max(zero["calls"], 1),
                                     zero["sender_cpu_s"], 100 * costs[-1]), flush=True)
    print_load("at the end")
    ratio = statistics.median(ratios)
    print()
    print("runtime.report each step, interleaved in the same ranks (%s, np=%d, batch %d):" % (args.launcher, NP,
                                                                                           args.batch_size))
    print("  ratio with/without (median over %d runs): %.3f   target >= %.2f   %s" % (
        args.rounds, ratio, REPORT_TARGET, "PASS" if ratio >= REPORT_TARGET else "MISS"))
    print("  median of all %d neighbouring block pairs: %.3f (quartiles %.3f-%.3f)" % (
        len(pairs), statistics.median(pairs), *statistics.quantiles(pairs, n=4)[::2]))
    cost = max(costs)
    print("  what reporting itself takes on rank 0 (calls + sending thread), largest of %d runs: %.3f%% of the "
          "training time, i.e. throughput >= %.4fx by accounting   target >= %.2f   %s" % (
              len(costs), 100 * cost, 1 - cost, REPORT_TARGET, "PASS" if 1 - cost >= REPORT_TARGET else "MISS"))
    return 0


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")  # as the test suite; both contenders
    kwargs = {"steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size}

    from airflow_provider_horovod import HorovodRunner, RunCancelledError

    signal.signal(signal.SIGTERM, _interrupt)  # a timeout still gets the summary of the rounds so far
    spark = make_spark()
    print("SparkSession local[2] up; Python %s; %d CPUs; %s" % (sys.version.split()[0], os.cpu_count(), kwargs))
    print_load("at the start")

    torch = args.launcher == "torch"
    body = train_ddp if torch else train
    with tempfile.TemporaryDirectory(prefix="hvd-throughput-bench-") as tmp:
        script = Path(tmp) / "train.py"
        source = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (watch_reset, watch_share, body))
        script.write_text((SCRIPT_DDP if torch else SCRIPT).format(source=source))
        out = Path(tmp) / "result.json"

        def horovodrun() -> dict:
            out.unlink(missing_ok=True)
            if torch:  # the anchor of launcher="torch": bare torchrun on this machine
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NP),
                       str(script), str(out), json.dumps(kwargs)]
            else:
                cmd = [HOROVODRUN, "-np", str(NP), "-H", "localhost:%d" % NP, "--mpi" if args.launcher == "mpirun" else "--gloo",
                       sys.executable, str(script), str(out), json.dumps(kwargs)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                raise RuntimeError("%s exited with %d:\n%s" % (cmd[0], proc.returncode, proc.stdout[-3000:]))
            return json.loads(out.read_text())

        def runner(report: bool = False, watch: bool = True) -> dict:
            extra = {"report": report} if not torch else {}
            try:
                return HorovodRunner(NP, launcher=args.launcher, spark=spark, driver_log_verbosity="log_callback_only",
                                     env={} if watch else {"HVDRUNNER_STALL_WATCH": "0"},
                                     on_report=lambda _report: None).run(body, **extra, **kwargs)
            except RunCancelledError as err:  # our own SIGTERM/Ctrl-C, turned into a cancel by the runner
                raise KeyboardInterrupt from err

        if args.mode == "interleaved":
            return interleaved(args, spark, kwargs)
        if args.mode == "stall":
            contenders = {"off": lambda: runner(watch=False), "armed": runner}
            names = {"off": "HorovodRunner(2) %s, no watch" % args.launcher,
                     "armed": "  + stall watch (default)"}
        elif args.mode == "report":
            contenders = {"runner": runner, "reporting": lambda: runner(report=True)}
            names = {"runner": "HorovodRunner(2) %s" % args.launcher,
                     "reporting": "  + runtime.report each step"}
        else:
            contenders = {"horovodrun": horovodrun, "runner": lambda: runner(report=args.report)}
            names = {"horovodrun": "torchrun --nproc-per-node 2" if torch else
                     "horovodrun -np 2 --%s" % ("mpi" if args.launcher == "mpirun" else "gloo"),
                     "runner": "HorovodRunner(2) %s%s" % (args.launcher, " + report" if args.report else "")}
        rates: dict[str, list[list[float]]] = {n: [] for n in contenders}

        warm_up(contenders, names)
        done = 0
        try:
            for r in range(args.rounds):
                run_round(contenders, rates, r, args.rounds)
                done += 1
        except KeyboardInterrupt:
            print("interrupted in round %d: the summary below covers the %d whole rounds before it" % (done + 1, done))
    spark.stop()
    print_load("at the end")
    if not done:
        print("no whole round: nothing to report")
        return 1

    summary(args, names, rates, done)
    return 0

if __name__ == "__main__":
    sys.exit(main())
