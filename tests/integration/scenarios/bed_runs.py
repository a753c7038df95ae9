"""The driver's side of the multi-host scenarios: runs inside the test bed's driver namespace, with
one SparkSession on the bed's standalone cluster, and writes what each run showed.

usage: python -m tests.integration.scenarios.bed_runs BED_JSON MASTER CONF_JSON OUT_JSON [RUN...]

The runs go in order (the rank0-lost runs lose rank 0's host and bring it back; the last one loses
a whole host for good). Each records its result or error, the
plan, its wall time and which runner processes (rank, orted, mpirun, reaper) were still alive on
each host afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUNNER_PROCESSES = ("airflow_provider_horovod.runner.rank.worker", "airflow_provider_horovod.runner.procs", "orted", "mpirun")


class LineWatch(logging.Handler):
    """Sets an event when a rank line streamed to the driver contains ``text``."""

    def __init__(self) -> None:
        super().__init__()
        self.text: str | None = None
        self.seen = threading.Event()

    def expect(self, text: str) -> threading.Event:
        self.seen.clear()
        self.text = text
        return self.seen

    def emit(self, record: logging.LogRecord) -> None:
        if self.text and self.text in record.getMessage():
            self.seen.set()


class Scenarios:
    def __init__(self, bed, spark, work: Path) -> None:
        self.bed = bed
        self.spark = spark
        self.work = work
        self.watch = LineWatch()
        logging.basicConfig(level=logging.WARNING)
        ranks = logging.getLogger("airflow_provider_horovod.ranks")
        ranks.setLevel(logging.INFO)
        ranks.addHandler(self.watch)

    # -- helpers ---------------------------------------------------------------------------------
    def leftovers(self, timeout: float = 10.0) -> dict[str, list[str]]:
        """Runner processes still alive on each host, after waiting up to ``timeout`` for them to go."""
        deadline = time.monotonic() + timeout
        while True:
            left = {h.name: self.bed.processes(h, *RUNNER_PROCESSES) for h in self.bed.hosts.values()}
            if not any(left.values()) or time.monotonic() > deadline:
                return {k: v for k, v in left.items() if v}
            time.sleep(0.2)

    def runs_mpirun(self, host) -> bool:
        import psutil

        for pid in self.bed.pids(host):
            try:
                if psutil.Process(pid).name() == "mpirun":
                    return True
            except psutil.Error:
                pass
        return False

    def run(self, runner, main: Callable, **kwargs: Any) -> dict[str, Any]:
        started = time.monotonic()
        out: dict[str, Any] = {}
        try:
            out["result"] = runner.run(main, **kwargs)
        except Exception as err:  # noqa: BLE001 - what the user would see is the point
            out.update(error_type=type(err).__name__, message=str(err), rank=getattr(err, "rank", None),
                       host=getattr(err, "host", None))
        out["ended_at"] = time.monotonic()
        out["wall_s"] = round(out["ended_at"] - started, 2)
        report = runner.last_run
        out["plan"] = next((e["slots"] for e in report.events if e.get("kind") == "plan"), None)
        out["phases"] = dict(report.phases)  # when the supervisor stopped the run, when the job ended
        out["orted_launched"] = sorted({e["executor"] for e in report.events if e.get("kind") == "orted-launched"})
        out["report"] = {k: getattr(report, k) for k in ("status", "artifact_transport", "artifact_bytes", "checkpoint_path",
                                                "timeline_path", "artifacts")}
        out["leftovers"] = self.leftovers()
        return out

    def runner(self, np: int, launcher: str, **kwargs: Any):
        from airflow_provider_horovod import HorovodRunner

        return HorovodRunner(np, launcher=launcher, spark=self.spark, **kwargs)

    def cancel_when(self, runner, event: threading.Event, timeout: float = 120) -> dict[str, float]:
        """Cancel ``runner`` from another thread once ``event`` is set; returns when it was cancelled."""
        when: dict[str, float] = {}

        def go() -> None:
            if event.wait(timeout):
                when["cancelled_at"] = time.monotonic()
                runner.cancel()

        threading.Thread(target=go, daemon=True).start()
        return when

    # -- the runs --------------------------------------------------------------------------------
    def layout(self, launcher: str, np: int) -> dict[str, Any]:
        """The ranks' layout; with np=2 (one rank per worker host), dataset= in the same run: each worker
        host's barrier task spills its rank's shard into its own private /tmp, and the rank reads it
        there (``result["then"]``); the rows never pass through the driver."""
        from tests.integration import dataset_jobs, jobs

        if np != 2:
            return self.run(self.runner(np, launcher), jobs.layout_then_job, tag="%s-%d" % (launcher, np))
        dataset = self.spark.range(DATASET_ROWS, numPartitions=3)
        return self.run(self.runner(np, launcher, dataset=dataset), jobs.layout_then_job, tag="%s-%d" % (launcher, np),
                        then=dataset_jobs.shard_job, batch_size=8)

    def torch_ddp(self) -> dict[str, Any]:
        """launcher="torch": unmodified DDP code, one rank per worker host, each reading its shard."""
        from tests.integration import torch_jobs

        dataset = self.spark.range(DATASET_ROWS, numPartitions=3)
        return self.run(self.runner(2, "torch", dataset=dataset), torch_jobs.ddp_job, steps=2, use_dataset=True)

    def torch_accelerate(self) -> dict[str, Any]:
        """launcher="torch": an accelerate loop, one process per worker host."""
        from tests.integration import torch_jobs

        return self.run(self.runner(2, "torch"), torch_jobs.accelerate_job, steps=1)

    def artifacts(self) -> dict[str, Any]:
        """np=4 (2 hosts x 2) under mpirun: the ranks' layout (``result["layout"]``); resume_from reaches
        every rank on both hosts; rank 0's checkpoints and timeline come back by stream (the driver
        cannot see a worker's /tmp)."""
        import torch

        from tests.integration import jobs

        resume = self.work / "resume"
        resume.mkdir()
        torch.manual_seed(0)
        torch.save({"epoch": 0, "model": torch.nn.Linear(3, 1).state_dict()}, resume / "epoch-0.pt")
        runner = self.runner(4, "mpirun", artifact_dir=self.work / "artifacts", resume_from=resume, timeline=True)
        out = self.run(runner, jobs.layout_then_job, tag="mpirun-4", then=jobs.checkpoint_job, epochs=3)
        if out.get("report", {}).get("checkpoint_path"):
            ckpt = Path(out["report"]["checkpoint_path"])
            out["checkpoints"] = sorted(p.name for p in ckpt.iterdir())
            out["last_epoch"] = torch.load(ckpt / "epoch-2.pt")["epoch"]
        return out

    def cancel_training(self, launcher: str) -> dict[str, Any]:
        from tests.integration import jobs

        runner = self.runner(2, launcher)
        when = self.cancel_when(runner, self.watch.expect("step 3"))
        out = self.run(runner, jobs.steps_job)
        out["cancel_to_return_s"] = round(time.monotonic() - when["cancelled_at"], 2) if when else None
        return out

    def cancel_transfer(self) -> dict[str, Any]:
        """Rank 0's host sends at 40 Mbit/s: a 48 MiB checkpoint takes ~10 s; cancel once part of it is in."""
        from tests.integration import jobs

        for host in self.bed.workers:
            self.bed.shape(host, "40mbit")
        try:
            artifact_dir = self.work / "cancelled-artifacts"
            runner = self.runner(2, "mpirun", artifact_dir=artifact_dir)
            arrived = threading.Event()

            def watch_staging() -> None:
                while not arrived.is_set():
                    for part in artifact_dir.glob(".incoming-*/**/*.partial"):
                        if part.stat().st_size > (4 << 20):
                            arrived.set()
                    time.sleep(0.05)

            threading.Thread(target=watch_staging, daemon=True).start()
            when = self.cancel_when(runner, arrived)
            out = self.run(runner, jobs.checkpoint_job, epochs=1, big_mb=48)
            arrived.set()
            out["cancel_to_return_s"] = round(time.monotonic() - when["cancelled_at"], 2) if when else None
            return out
        finally:
            for host in self.bed.workers:
                self.bed.unshape(host)

    def rank_killed(self, launcher: str) -> dict[str, Any]:
        from tests.integration import jobs

        return self.run(self.runner(2, launcher), jobs.sigkill_job, victim=1)

    def channel_blocked(self) -> dict[str, Any]:
        """A firewall in front of the driver lets the executors reach Spark's ports only (the bed
        gives the driver's other ports the range 40960-41983): one host cannot reach the channel."""
        from tests.integration import jobs

        blocked = self.bed.workers[-1]
        self.bed.block_new_connections(blocked, self.bed.driver, 0xA000, 0xFC00)
        try:
            out = self.run(self.runner(2, "mpirun", start_timeout=40), jobs.allreduce_job)
        finally:
            self.bed.unshape(blocked)
        out["blocked_host"] = blocked.address
        return out

    def rank0_host_lost(self, launcher: str) -> dict[str, Any]:
        """Rank 0's host dies mid-training (every process on it killed at once) once it committed at
        least three checkpoint versions with ``commit_checkpoint``, one a step; the host comes back (its
        Spark worker started again) and the retry resumes from what the store's resume search finds
        in the failed try."""
        from airflow_provider_horovod import store
        from airflow_provider_horovod.runner.driver import versions
        from tests.integration import jobs

        task = self.work / ("rank0-lost-%s" % launcher)  # the task folder: try-1 fails, try-2 resumes
        first = task / "try-1"
        runner = self.runner(2, launcher, artifact_dir=first, keep_checkpoints=1000)
        killed: dict[str, Any] = {}
        executors_before = self.executors()

        def kill_rank0_host() -> None:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                seen = versions.committed(first)
                if sum(v.step is not None for v, _ in seen) >= 3:  # three of commit_checkpoint's, rank 0's host in each
                    host = (seen[-1][1] / "host.txt").read_text()  # rank 0's host's address, in each of its versions
                    victim = next(h for h in self.bed.workers if h.address == host)
                    ran_mpirun = self.runs_mpirun(victim)
                    seen = versions.committed(first)  # the last look before the loss
                    killed.update(host=victim.address, name=victim.name, ran_mpirun=ran_mpirun, at=time.monotonic(),
                                  processes=self.bed.kill_host(victim), versions=[v.to_json() for v, _ in seen])
                    return
                time.sleep(0.05)
            runner.cancel()  # never three versions: the run ends here, and the test says the host was not lost

        threading.Thread(target=kill_rank0_host, daemon=True).start()
        try:
            out = self.run(runner, jobs.host_versions_job, steps=400, pause=0.5)
        finally:
            victim = next((h for h in self.bed.workers if h.address == killed.get("host")), None)
            if victim is not None:
                self.bring_back(victim, executors_before)
        out["killed"] = killed
        out["kill_to_error_s"] = round(out["ended_at"] - killed["at"], 2) if killed else None
        out["listed"] = [v["seq"] for v in runner.last_run.checkpoints]
        out["entries"] = sorted(p.name for p in (first / versions.VERSIONS).iterdir())
        out["offered"] = offered_versions(first)
        found = store.latest_checkpoint(store.storage_path(task / "try-2"), 2)  # what a retry's resume search finds
        if found is None:
            return out
        out["resume"] = {"path": found.path.path, "try_number": found.try_number, "seq": found.seq, "step": found.step,
                         "describe": found.describe()}
        retry = self.runner(2, launcher, artifact_dir=task / "try-2", resume_from=found.path.path)
        out["retry"] = self.run(retry, jobs.host_versions_job, steps=(found.step or 0) + 3, pause=0.0)
        final = out["retry"]["report"]["checkpoint_path"]
        out["retry"]["final_step"] = int((Path(final) / "step.txt").read_text()) if final else None
        return out

    def executors(self) -> set[str]:
        """``host:port`` of each executor the driver knows now (not the driver itself)."""
        infos = self.spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
        return {"%s:%d" % (e.host(), e.port()) for e in infos if e.host() != self.bed.driver.address}

    def bring_back(self, host, executors_before: set[str], timeout: float = 120) -> None:
        """The lost host is replaced: its Spark worker starts again, and the runs after this one find
        an executor on each worker host, none of them one the driver knew before the loss."""
        from tests.integration.netbed import BedCluster

        logs = self.work / ("restarted-%s" % host.name)
        logs.mkdir(exist_ok=True)
        BedCluster(self.bed, logs).start_worker(host)
        deadline = time.monotonic() + timeout
        lost = {e for e in executors_before if e.rsplit(":", 1)[0] == host.address}
        while True:
            now = self.executors()
            if len(now) == len(self.bed.workers) and not now & lost:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("host %s came back, but its executor did not register: %s" % (host.name, now))
            time.sleep(0.2)

    def host_lost(self) -> dict[str, Any]:
        """A whole worker host dies mid-training (every process on it killed at once) with
        ``max_restarts=1``: the same ``run()`` restarts on the capacity that is left (the other
        host's two slots), from the newest version committed before the loss."""
        from tests.integration import jobs

        committed: list[int] = []
        runner = self.runner(2, "mpirun", max_restarts=1, start_timeout=30, artifact_dir=self.work / "host-lost",
                             on_checkpoint=lambda version, _path: committed.append(version.step))
        killed: dict[str, Any] = {}

        def kill() -> None:
            deadline = time.monotonic() + 120
            while max((s for s in committed if s is not None), default=-1) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            # the host without mpirun: rank 0's host (mpirun runs in partition 0's task) survives
            victim = next(h for h in self.bed.workers if not self.runs_mpirun(h))
            killed.update(host=victim.address, newest_step=max(s for s in committed if s is not None),
                          processes=self.bed.kill_host(victim))

        threading.Thread(target=kill, daemon=True).start()
        out = self.run(runner, jobs.restartable_job, steps=20)
        out["killed"] = killed
        out["attempts"] = runner.last_run.attempts_json()
        out["plans"] = [e["slots"] for e in runner.last_run.events if e.get("kind") == "plan"]
        survivors = [h for h in self.bed.workers if h.address != killed.get("host")]
        out["survivor_leftovers"] = {h.name: self.bed.processes(h, *RUNNER_PROCESSES) for h in survivors}
        return out


def offered_versions(folder: Path) -> list[dict[str, Any]]:
    """The committed versions of a try folder as a reader finds them: each marker, whether every file
    it lists is there at its size, and, for a version with a step, whether its files hold that step."""
    from airflow_provider_horovod.runner.driver import versions

    found = []
    for version, path in versions.committed(folder):
        files = dict(version.files)
        whole = all((path / rel).is_file() and (path / rel).stat().st_size == size for rel, size in files.items())
        readable = None
        if version.step is not None and whole:
            weights = (path / "weights.bin").read_bytes()
            readable = (path / "step.txt").read_text() == str(version.step) and weights == bytes(
                [version.step % 256]) * len(weights)
        found.append({**version.to_json(), "name": path.name, "whole": whole, "readable": readable})
    return found


def wait_for_executors(spark, n: int, timeout: float = 120) -> None:
    """Until ``n`` executors (one per worker host) have registered. The runner waits only for ``np``
    barrier slots, which the first executor alone has (2 cores): a first run started before the
    second executor registers puts both ranks on one host (local_size 2, cross_size 1)."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout
    while len(tracker.getExecutorInfos()) - 1 < n:  # the driver is listed too
        if time.monotonic() > deadline:
            raise RuntimeError("only %d of %d executors registered" % (len(tracker.getExecutorInfos()) - 1, n))
        time.sleep(0.2)


DATASET_ROWS = 101  # odd: the two shards differ by one row
# mpirun-2 and gloo-2 run dataset= too; artifacts (np=4 under mpirun) shows mpirun's layout of 2 hosts x 2
RUNS = ("mpirun-2", "gloo-2", "gloo-4", "torch-2", "torch-accelerate", "artifacts", "cancel-training", "cancel-transfer",
        "rank-killed-mpirun", "rank-killed-gloo", "channel-blocked", "rank0-lost-mpirun", "rank0-lost-gloo", "host-lost")


def main() -> None:
    bed_json, master, conf, out_path = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    wanted = sys.argv[5:] or list(RUNS)
    from pyspark.sql import SparkSession

    from tests.integration.netbed import NetBed

    bed = NetBed.from_json(bed_json)
    builder = SparkSession.builder.master(master).appName("hvdrunner-bed-tests")
    for key, value in conf.items():
        builder = builder.config(key, value)
    began = time.monotonic()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    wait_for_executors(spark, len(bed.workers))
    print("bed session ready: %.1f s" % (time.monotonic() - began), flush=True)
    work = Path(out_path).parent / "driver"  # next to the output: the test reads the committed artifacts
    work.mkdir()
    from tests.integration import dataset_jobs, jobs

    jobs.by_value(dataset_jobs)
    s = Scenarios(bed, spark, work)
    calls: dict[str, Callable[[], dict[str, Any]]] = {
        "mpirun-2": lambda: s.layout("mpirun", 2), "gloo-2": lambda: s.layout("gloo", 2),
        "gloo-4": lambda: s.layout("gloo", 4),
        "artifacts": s.artifacts, "cancel-training": lambda: s.cancel_training("gloo"),
        "cancel-transfer": s.cancel_transfer, "rank-killed-mpirun": lambda: s.rank_killed("mpirun"),
        "rank-killed-gloo": lambda: s.rank_killed("gloo"), "channel-blocked": s.channel_blocked,
        "rank0-lost-mpirun": lambda: s.rank0_host_lost("mpirun"), "rank0-lost-gloo": lambda: s.rank0_host_lost("gloo"),
        "host-lost": s.host_lost, "torch-2": s.torch_ddp,
        "torch-accelerate": s.torch_accelerate,
    }
    results: dict[str, Any] = {"driver_pid": os.getpid()}
    try:
        for name in wanted:
            began = time.monotonic()
            try:
                results[name] = calls[name]()
            except Exception:  # noqa: BLE001 - the scenario broke, not the engine: the test says which
                results[name] = {"scenario_error": traceback.format_exc()}
            # run(): the engine's wall time; in all: with the checks for leftovers, a retry, a host brought back
            print("bed run %s: run() %s s, %.1f s in all" % (name, results[name].get("wall_s"), time.monotonic() - began),
                  flush=True)
            with open(out_path, "w") as f:
                json.dump(results, f, default=str)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
