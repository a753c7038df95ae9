"""The engine on a real Spark standalone cluster (two executors = two hosts) and on Spark Connect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_horovod.runner.options import DEFAULT_LAST_CALL_S
from tests.integration import dataset_jobs
from tests.integration.cluster import StandaloneCluster
from tests.integration.scenarios.cluster_runs import DATASET_ROWS
from tests.integration.scenarios.restart_runs import DATASET_ROWS as RESTART_DATASET_ROWS
from tests.integration.scenarios.restart_runs import HOST_START_TIMEOUT_S as RESTART_HOST_START_TIMEOUT_S
from tests.integration.scenarios.restart_runs import VICTIMS as RESTART_VICTIMS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _run_module(module: str, *args: str, timeout: float = 300) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two workers, with decommission enabled (the host-loss run needs it; nothing before it
    decommissions, so the other runs see no difference)."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), decommission=True).start()
    yield cluster
    cluster.stop()


LATE_S = 10  # the late executor's worker starts this long after its run() is called (it registers seconds later)


@pytest.fixture(scope="module")
def cluster_scenarios(cluster, tmp_path_factory):
    """Every scenario on the module's cluster, in one application (``scenarios/cluster_runs.py``): the
    np=2 jobs; per launcher, the executors of rank 1 then rank 0 killed; the worker hosting rank 1
    decommissioned, then gone for good; last, on the one worker left, an np=2 run with start_timeout=60
    whose second worker (and so its executor) this fixture starts LATE_S into it: the run is already
    waiting for its second slot then (the log says so)."""
    from tests.integration.scenarios.late_executor import STARTED

    out = tmp_path_factory.mktemp("cluster-out")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.scenarios.cluster_runs", cluster.master,
                             json.dumps(cluster.app_conf()), str(out), "mpirun", "gloo", "torch", "gloo/host"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 360
        while not (out / STARTED).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / STARTED).exists(), "".join(output)[-5000:]
        time.sleep(max(0.0, float((out / STARTED).read_text()) + LATE_S - time.time()))
        cluster.start_worker(2)
        proc.wait(timeout=120)
        reader.join(10)
        assert proc.returncode == 0, "".join(output)[-8000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print("".join(line for line in output if line.startswith("cluster s")))
    return {name: json.loads((out / ("%s.json" % name)).read_text()) for name in ("runs", "restarts", "late")}


@pytest.fixture(scope="module")
def cluster_runs(cluster_scenarios):
    return cluster_scenarios["runs"]


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_two_executors_are_two_hosts_with_one_rank_each(cluster_runs, launcher):
    result = cluster_runs[launcher]["result"]
    assert result["sum"] == 3.0
    layout = [(r["rank"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in result["ranks"]]
    assert layout == [(0, 0, 1, 0, 2), (1, 0, 1, 1, 2)]


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_each_rank_sees_exactly_its_own_tasks_gpu(cluster_runs, launcher):
    devices = [r["cuda_visible_devices"] for r in cluster_runs[launcher]["result"]["ranks"]]
    plan = next(e for e in cluster_runs[launcher]["events"] if e.get("kind") == "plan")
    assert devices == [",".join(slot["gpus"]) for slot in plan["slots"]]
    assert all(d is not None and len(d.split(",")) == 1 for d in devices)
    assert len(set(devices)) == 2  # two executors, two different GPUs
    # each rank's own GPU is its cuda:0, whatever its address on the machine
    assert [r["device"] for r in cluster_runs[launcher]["result"]["ranks"]] == ["cuda:0", "cuda:0"]


def test_torch_ddp_on_two_executors_gives_each_rank_its_own_gpu_as_a_node_of_one(cluster_runs):
    got = cluster_runs["torch"]
    ranks, plan = got["result"]["ranks"], got["plan"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in ranks] == [",".join(slot["gpus"]) for slot in plan]
    assert all(slot["gpus"] for slot in plan)  # the cluster gives every task one (simulated) GPU
    # a task with its own GPU is a torch node of one: torch.cuda.set_device(LOCAL_RANK) picks that GPU
    assert [(r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"], r["env"]["GROUP_RANK"]) for r in ranks] == [
        ("0", "1", "0"), ("0", "1", "1")]
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:0"]
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {plan[0]["address"]}
    assert [r["rows"] for r in ranks] == [-(-DATASET_ROWS // 2)] * 2  # ceil(101 / 2): the shorter shard wraps


def test_an_accelerate_function_runs_on_two_executors(cluster_runs):
    got = cluster_runs["accelerate"]
    assert (got["processes"], got["index"], got["distributed"]) == (2, 0, "DistributedType.MULTI_CPU")
    assert got["weights"][0] == got["weights"][1]


def test_mpirun_reaches_the_second_executor_through_the_exec_service(cluster_runs):
    events = cluster_runs["mpirun"]["events"]
    launched = {e["executor"] for e in events if e.get("kind") == "orted-launched"}
    assert len(launched) == 2  # orted was started by the exec service in each executor's task
    ranks = cluster_runs["mpirun"]["result"]["ranks"]
    assert ranks[0]["pid"] != ranks[1]["pid"]


def test_two_daemons_on_one_machine_never_share_an_open_mpi_session_directory(cluster_runs):
    # Both executors run on this machine: each orted must have a session directory of its own, or
    # their setup races (mpirun: "ORTE was unable to reliably start one or more daemons").
    dirs = [r["orte_tmpdir"] for r in cluster_runs["mpirun"]["result"]["ranks"]]
    assert None not in dirs and len(set(dirs)) == 2
    assert not any(os.path.exists(d) for d in dirs)  # removed with the task


def test_checkpoint_is_pulled_from_an_executor_outside_the_drivers_process_tree(cluster_runs):
    import torch

    got = cluster_runs["artifacts"]
    assert got["driver_pid"] not in got["result"]["rank0_ancestors"]  # rank 0 ran under another JVM
    checkpoint = Path(got["last_run"]["checkpoint_path"])
    assert torch.load(checkpoint / "epoch-1.pt")["epoch"] == 1
    assert json.loads(Path(got["last_run"]["timeline_path"]).read_text())
    assert got["last_run"]["artifacts"]["status"] == "success"
    assert got["last_run"]["artifact_transport"] == "stream"


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_dataset_shards_are_spilled_by_each_executors_task_for_the_rank_beside_it(cluster_runs, launcher):
    got = cluster_runs["dataset-" + launcher]
    plan = next(e for e in got["events"] if e.get("kind") == "plan")["slots"]
    assert len({slot["executor"] for slot in plan}) == 2  # one rank per executor
    dataset_jobs.assert_shards_are_the_dataset(got["result"], DATASET_ROWS, plan)
    assert [r["steps"] for r in got["result"]] == [7, 7]  # ceil(51 / 8) on both ranks


@pytest.fixture(scope="module")
def restart_runs(cluster_scenarios):
    """Per launcher, the executors of rank 1 then rank 0 killed; last (it leaves the cluster one worker
    short): the worker hosting rank 1 decommissioned, then gone for good."""
    return cluster_scenarios["restarts"]


@pytest.mark.parametrize("launcher", ["mpirun", "gloo", "torch"])
def test_the_executors_of_rank_1_then_rank_0_killed_mid_training_cost_one_restart_each_of_the_same_run_from_the_newest_version(
        restart_runs, launcher):
    got = restart_runs[launcher]
    attempts = got["attempts"]
    # the executor JVM of rank 1 in attempt 0, of rank 0 (mpirun, the rendezvous, torch's store) in attempt 1:
    # each SIGKILLed after rank 0 committed the attempt's fourth step or a later one
    assert RESTART_VICTIMS == [1, 0] and len(got["kills"]) == 2
    assert [a["ending"] for a in attempts] == ["lost", "lost", "success"]
    started = 0
    for lost, restarted, kill, victim in zip(attempts, attempts[1:], got["kills"], RESTART_VICTIMS):
        assert lost["cause"].startswith("The barrier task of partition %d on host hvdhost%d" % (victim, victim))
        assert "died" in lost["cause"]
        # nothing committed before the loss is lost
        assert restarted["resumed_from"]["step"] >= kill["newest_step"] >= started + 3
        assert 0 < restarted["restart_s"] < 30  # from the loss to the next attempt's ranks starting
        started = restarted["resumed_from"]["step"] + 1
    # under torch, TORCHELASTIC_RESTART_COUNT is the attempt, as torchrun counts its group's restarts
    # (max_restarts=2): a script that resumes when it is above 0 resumes (on main's code: "0", "0")
    torchelastic = {"torchelastic": ["2", "2"]} if launcher == "torch" else {}
    assert got["result"] == {"start": started, "attempt": 2, "size": 2, **torchelastic}


@pytest.mark.parametrize("launcher", ["mpirun", "gloo", "torch"])
def test_an_engine_run_without_artifact_dir_keeps_every_committed_version_in_its_run_folder_for_its_restarts(
        restart_runs, launcher):
    from airflow_provider_horovod.runner.driver.versions import committed

    got = restart_runs[launcher]  # HorovodRunner(2, max_restarts=2): no artifact_dir
    folder = Path(got["artifact_dir"])
    assert folder.parent == Path(os.environ["HVDRUNNER_RUNS_DIR"])  # the test session's root (conftest.py)
    # each restart resumed from the newest version committed before its loss (on main's code: "resumes from
    # the start: no checkpoint version was committed"), and the newest of the run is still there after it, with
    # the one before it (keep_checkpoints=2)
    for restarted, kill in zip(got["attempts"][1:], got["kills"]):
        assert restarted["resumed_from"]["step"] >= kill["newest_step"] is not None
    steps = [v["step"] for v in got["checkpoints"]]
    assert [v.step for v, _path in committed(folder)] == steps[-2:]
    assert (committed(folder)[-1][1] / "step.txt").read_text() == str(steps[-1])


@pytest.fixture(scope="module")
def host_loss_run(restart_runs):
    """The worker hosting rank 1 is decommissioned, then killed for good once rank 0 committed the
    version the notice asks for (10 s after the notice at most)."""
    return restart_runs["gloo/host"]


def test_a_host_decommissioned_before_it_is_gone_loses_no_step_and_the_run_finishes_on_the_ranks_left(
        host_loss_run):
    lost, restarted = host_loss_run["attempts"]
    assert (lost["np"], lost["ending"], restarted["np"], restarted["ending"]) == (2, "lost", 1, "success")
    (notice,) = host_loss_run["notices"]  # the driver saw Spark decommission the executor and told every task
    assert notice["executors"]
    (kill,) = host_loss_run["kills"]
    # rank 0 committed one version, after the step every rank agreed the notice came (step 3 or later: the
    # decommission followed step 3); no rank stepped on, and the restart resumed from it: no step lost
    assert [s for s in kill["committed"] if s is not None] == [restarted["resumed_from"]["step"]]
    assert restarted["resumed_from"]["step"] >= 3
    # dataset= follows the smaller restart: the one rank left reads every row (2 shards in attempt 0)
    assert host_loss_run["result"] == {"start": restarted["resumed_from"]["step"] + 1, "attempt": 1, "size": 1,
                                       "rows": RESTART_DATASET_ROWS}


def test_a_worker_gone_for_good_with_min_np_starts_the_shrunken_attempt_at_once_as_spark_decommissioned_it(
        host_loss_run):
    # min_np=1 of np=2, start_timeout=60 s, the default last_call (30 s): Spark decommissioned the worker with its
    # executor, so its slot cannot come back; the restart runs on the one slot left at once, well within last
    # call + 15 s of the loss (on main's code it waited start_timeout)
    (notice,) = host_loss_run["notices"]
    assert host_loss_run["workers_gone"] == notice["executors"]  # Spark said the executor's worker goes with it
    assert RESTART_HOST_START_TIMEOUT_S > DEFAULT_LAST_CALL_S
    assert host_loss_run["last_started_after_kill_s"] < DEFAULT_LAST_CALL_S
    assert host_loss_run["attempts"][1]["np"] == 1


@pytest.fixture(scope="module")
def late_executor_run(cluster_scenarios):
    return cluster_scenarios["late"]


def test_an_executor_that_registers_10_s_late_within_start_timeout_joins_the_run_and_the_log_says_what_was_waited_for(
        late_executor_run):
    assert "error" not in late_executor_run, late_executor_run["error"]
    ranks = late_executor_run["result"]["ranks"]
    assert [r["cross_size"] for r in ranks] == [2, 2]  # the late executor is a host of its own
    assert LATE_S < late_executor_run["run_s"] < 60
    log = late_executor_run["log"]
    assert any(re.match(r"Waiting up to start_timeout=60s for 2 barrier slots: the cluster has [01] now", line)
               for line in log), log
    waited = [line for line in log if line.startswith("The cluster has 2 barrier slots after waiting")]
    assert waited and float(waited[0].split("waiting ")[1].split(" s")[0]) > LATE_S, log


@pytest.fixture(scope="module")
def connect_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("connect-out") / "connect.json"
    _run_module("tests.integration.scenarios.connect_run", str(out))
    return json.loads(out.read_text())


def test_spark_connect_session_runs_ddp_and_accelerate_under_the_torch_launcher(connect_runs):
    assert connect_runs["accelerate"]["processes"] == 2
    assert connect_runs["accelerate"]["weights"][0] == connect_runs["accelerate"]["weights"][1]
    ranks = connect_runs["torch"]["ranks"]
    assert ranks[0]["weights"] == ranks[1]["weights"] and [r["rank"] for r in ranks] == [0, 1]
    assert [r["rows"] for r in ranks] == [-(-DATASET_ROWS // 2)] * 2  # ceil(101 / 2): the shorter shard wraps


def test_spark_connect_session_runs_gloo_and_returns_rank_zeros_value_and_takes_a_connect_dataframe(connect_runs):
    got = connect_runs
    assert got["session"].startswith("pyspark.sql.connect")
    assert got["result"]["tag"] == "connect" and got["result"]["sum"] == 3.0
    for launcher in ("mpirun", "gloo"):  # dataset= takes a Connect DataFrame as it takes a classic one
        assert got["dataset-" + launcher]["dataframe"].startswith("pyspark.sql.connect")
        dataset_jobs.assert_shards_are_the_dataset(got["dataset-" + launcher]["result"], DATASET_ROWS)
