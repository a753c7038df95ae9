"""The engine across real hosts: a driver host and two worker hosts, each in its own network
namespace with its own address, its own interface name and its own /tmp (``netbed.py``), a Spark
standalone master on the driver host and one worker per worker host, each bound to its address.

One bed (torn down after this module) and one SparkSession serve every test here: the driver's
side of all scenarios runs once, in order, inside the driver's namespace (``scenarios/bed_runs.py``),
and each test reads what one run showed. Two runs lose rank 0's host and bring it back; the last one
loses a whole host for good.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration import dataset_jobs
from tests.integration.netbed import BedCluster, NetBed
from tests.integration.scenarios.bed_runs import DATASET_ROWS

pytestmark = pytest.mark.slow
SCENARIO_TIMEOUT_S = 540
SAME_NAME = "trainer-0"


@pytest.fixture(scope="module")
def netbed():
    why = NetBed.unavailable()
    if why is not None:
        pytest.skip(why)
    # Both workers are called alike, as containers named trainer-0 in two pods, and worker b has
    # Docker's 64 MiB /dev/shm: every run here shows that neither confuses the plan.
    bed = NetBed(workers=2, hostname=SAME_NAME, shm={"b": "64m"})
    try:
        bed.up()
        # The driver's own ports (the engine's channel among them) come from this range; Spark's
        # are fixed outside it (BedCluster.app_conf), so a firewall can tell them apart.
        bed.set_port_range(bed.driver, 40960, 41983)
        yield bed
    finally:
        bed.down()
        assert bed.leftovers() == []


@pytest.fixture(scope="module")
def bed_cluster(netbed, tmp_path_factory):
    cluster = BedCluster(netbed, tmp_path_factory.mktemp("bed-spark-logs"), cores=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def bed_runs(netbed, bed_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("bed-out") / "runs.json"
    runs = os.environ.get("HVDTB_RUNS", "").split()  # a subset, to debug one scenario
    got = bed_cluster.run_scenarios(out, runs, SCENARIO_TIMEOUT_S)
    print("\n".join(line for line in got["_output"].splitlines() if line.startswith("bed ")))  # seconds per run
    return got


def run_of(bed_runs, name: str) -> dict:
    got = bed_runs.get(name)
    assert got is not None, "run %s did not happen:\n%s" % (name, bed_runs["_output"][-3000:])
    assert "scenario_error" not in got, got["scenario_error"]
    return got


def hosts_of(plan: list[dict]) -> list[str]:
    return [slot["address"] for slot in plan]


def test_each_bed_host_has_its_own_address_interface_files_and_dev_shm_under_one_shared_host_name(netbed, tmp_path):
    driver_file = tmp_path / "only-on-the-driver"
    driver_file.write_text("x")
    names = set()
    for host in netbed.workers:
        def on_host(*argv: str) -> subprocess.CompletedProcess:
            return netbed.run(host, list(argv), capture_output=True, text=True)

        assert on_host("cat", str(driver_file)).returncode != 0  # the driver's /tmp is not this host's
        addrs = on_host("ip", "-o", "-4", "addr", "show", "dev", host.iface).stdout
        assert "%s/24" % host.address in addrs
        names.add(on_host("hostname").stdout.strip())
    assert names == {SAME_NAME}  # two containers called alike
    assert len({h.iface for h in netbed.hosts.values()}) == len(netbed.hosts)
    shm = [netbed.run(h, ["df", "-B1", "--output=size", "/dev/shm"], capture_output=True, text=True).stdout.split()[-1]
           for h in netbed.workers]
    assert int(shm[1]) == 64 * 1024 * 1024 and int(shm[0]) > 64 * 1024 * 1024


def test_a_host_with_a_64_mib_dev_shm_is_warned_about_before_its_ranks_start_naming_it(netbed, bed_runs):
    small = netbed.hosts["b"].address
    said = "/dev/shm on host %s (executor %s:" % (SAME_NAME, small)
    warnings = [line for line in bed_runs["_output"].splitlines() if said in line]
    assert all("address %s) is 64 MiB for" % small in w and "--shm-size" in w for w in warnings), warnings
    assert any("64 MiB for 1 rank(s)" in w for w in warnings) and any("64 MiB for 2 rank(s)" in w for w in warnings)
    assert not [line for line in bed_runs["_output"].splitlines() if "/dev/shm on host" in line and small not in line]


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_one_rank_per_host_across_hosts_whose_interfaces_are_named_differently(netbed, bed_runs, launcher):
    got = run_of(bed_runs, "%s-2" % launcher)
    assert "error_type" not in got, got.get("message")
    result = got["result"]["layout"]
    assert result["sum"] == 3.0
    layout = [(r["rank"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in result["ranks"]]
    assert layout == [(0, 0, 1, 0, 2), (1, 0, 1, 1, 2)]
    worker_addresses = {h.address for h in netbed.workers}
    assert set(hosts_of(got["plan"])) == worker_addresses  # one rank on each worker host
    assert {slot["iface"] for slot in got["plan"]} == {h.iface for h in netbed.workers}  # eth0 and ens5
    assert {slot["network"] for slot in got["plan"]} == {"%s.0/24" % netbed.subnet}
    if launcher == "mpirun":  # orted started on each host by that host's exec service
        assert {e.rsplit(":", 1)[0] for e in got["orted_launched"]} == worker_addresses
    assert got["leftovers"] == {}


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_two_hosts_with_two_slots_each_give_local_and_cross_ranks_as_horovod(netbed, bed_runs, launcher):
    got = run_of(bed_runs, {"mpirun": "artifacts", "gloo": "gloo-4"}[launcher])  # mpirun's np=4 run is artifacts'
    assert "error_type" not in got, got.get("message")
    result = got["result"]["layout"]
    assert result["sum"] == 10.0
    layout = [(r["rank"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in result["ranks"]]
    assert layout == [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]
    addresses = hosts_of(got["plan"])
    assert addresses[0] == addresses[1] != addresses[2] == addresses[3]  # ranks contiguous per host
    assert got["leftovers"] == {}


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_dataset_shards_lie_on_the_host_of_the_rank_that_reads_them(netbed, bed_runs, launcher):
    got = run_of(bed_runs, "%s-2" % launcher)  # the np=2 layout run reads a dataset= too
    assert "error_type" not in got, got.get("message")
    ranks = got["result"]["then"]
    assert set(hosts_of(got["plan"])) == {h.address for h in netbed.workers}  # one rank on each worker host
    assert len({r["host"] for r in ranks}) == 2  # read where it was spilled: each host's own /tmp
    dataset_jobs.assert_shards_are_the_dataset(ranks, DATASET_ROWS, got["plan"])
    assert got["leftovers"] == {}


def assert_torch_ran_across_the_hosts(netbed, got: dict) -> None:
    """A ``torch_jobs.ddp_job`` run of the bed: one rank per worker host, torch's store at rank 0's
    address, each rank's Gloo on its own host's interface, the ranks in sync, nothing left behind."""
    assert "error_type" not in got, got.get("message")
    ranks, plan = got["result"]["ranks"], got["plan"]
    assert set(hosts_of(plan)) == {h.address for h in netbed.workers}  # one rank on each worker host
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {plan[0]["address"]}  # never 127.0.x.1
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in ranks] == [slot["iface"] for slot in plan]
    assert [(r["env"]["GROUP_RANK"], r["env"]["LOCAL_RANK"]) for r in ranks] == [("0", "0"), ("1", "0")]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert got["leftovers"] == {}


def test_torch_ddp_runs_one_rank_per_host_on_each_hosts_own_interface(netbed, bed_runs):
    got = run_of(bed_runs, "torch-2")
    assert_torch_ran_across_the_hosts(netbed, got)
    assert [r["rows"] for r in got["result"]["ranks"]] == [-(-DATASET_ROWS // 2)] * 2  # ceil(101 / 2): the shorter shard wraps


def test_an_accelerate_function_runs_one_process_per_host(netbed, bed_runs):
    got = run_of(bed_runs, "torch-accelerate")
    assert "error_type" not in got, got.get("message")
    assert set(hosts_of(got["plan"])) == {h.address for h in netbed.workers}
    assert got["result"]["processes"] == 2 and got["result"]["weights"][0] == got["result"]["weights"][1]
    assert got["leftovers"] == {}


def test_checkpoint_and_timeline_come_back_by_stream_and_resume_from_reaches_every_host(netbed, bed_runs):
    got = run_of(bed_runs, "artifacts")
    assert "error_type" not in got, got.get("message")
    result = got["result"]["then"]
    assert result["start"] == 1  # every rank resumed after epoch 0 of resume_from
    assert len(result["resume_seen"]) == 4 and None not in result["resume_seen"]
    assert len(set(hosts_of(got["plan"]))) == 2
    # The driver cannot read a worker host's /tmp: the files came over the channel.
    assert got["report"]["artifact_transport"] == "stream"
    assert got["checkpoints"] == ["epoch-1.pt", "epoch-2.pt"] and got["last_epoch"] == 2
    assert got["report"]["status"] == "success" and got["report"]["artifacts"]["complete"] is True
    assert json.loads(Path(got["report"]["timeline_path"]).read_text())
    assert got["leftovers"] == {}


def test_cancel_mid_training_leaves_no_process_on_any_host(bed_runs):
    got = run_of(bed_runs, "cancel-training")
    assert got["error_type"] == "RunCancelledError", got.get("message")
    assert got["cancel_to_return_s"] is not None and got["cancel_to_return_s"] <= 10
    assert got["leftovers"] == {}


def test_cancel_mid_transfer_leaves_no_process_and_no_complete_checkpoint(bed_runs):
    got = run_of(bed_runs, "cancel-transfer")
    assert got["error_type"] == "RunCancelledError", got.get("message")
    assert got["cancel_to_return_s"] is not None and got["cancel_to_return_s"] <= 10
    assert got["report"]["artifacts"]["complete"] is False
    assert got["leftovers"] == {}


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_rank_killed_on_one_host_fails_the_run_naming_rank_and_host(netbed, bed_runs, launcher):
    got = run_of(bed_runs, "rank-killed-%s" % launcher)
    assert got["error_type"] == "HorovodRunError"
    assert got["rank"] == 1 and "SIGKILL" in got["message"]
    rank1_host = got["plan"][1]["address"]
    assert rank1_host in got["message"]  # the executor's address names the machine
    assert got["leftovers"] == {}


def test_executors_that_cannot_reach_the_drivers_channel_get_an_error_naming_it(netbed, bed_runs):
    got = run_of(bed_runs, "channel-blocked")
    assert got["error_type"] == "HorovodRunError", got.get("message")
    assert "%s:" % netbed.driver.address in got["message"] and got["blocked_host"] in got["message"]
    assert "spark.driver.host" in got["message"]
    assert got["wall_s"] <= 40  # within start_timeout
    assert got["leftovers"] == {}


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_rank0s_host_lost_keeps_every_committed_version_and_the_retry_resumes_from_the_newest(netbed, bed_runs,
                                                                                            launcher):
    got = run_of(bed_runs, "rank0-lost-%s" % launcher)
    killed = got["killed"]
    assert killed and killed["processes"] > 0, got.get("message")
    assert got["plan"][0]["address"] == killed["host"]  # the host lost was rank 0's ...
    assert killed["ran_mpirun"] is (launcher == "mpirun")  # ... and, under mpirun, mpirun's too
    assert got["error_type"] == "HorovodRunError", got.get("message")
    assert killed["host"] in got["message"]
    assert got["kill_to_error_s"] <= 60
    assert got["leftovers"] == {}
    # The failed try's folder holds every version committed before the loss, each whole, none half-offered.
    offered = {v["seq"]: v for v in got["offered"]}
    before = killed["versions"]
    assert len([v for v in before if v["step"] is not None]) >= 3
    assert [{k: offered.get(v["seq"], {}).get(k) for k in v} for v in before] == before, got["offered"]
    assert sorted(offered) == list(range(1, len(offered) + 1)) == got["listed"]
    assert all(v["whole"] for v in offered.values())
    assert [e for e in got["entries"] if not e.startswith(".")] == [v["name"] for v in got["offered"]]
    newest = got["offered"][-1]
    assert newest["readable"] is True and newest["step"] >= before[-1]["step"]
    assert got["report"]["status"] == "failed" and got["report"]["artifacts"]["complete"] is False
    assert got["report"]["checkpoint_path"].endswith("/versions/%s" % newest["name"])
    # The retry's resume search finds the newest version of the failed try, and training goes on after its step.
    resume = got["resume"]
    assert (resume["try_number"], resume["seq"], resume["step"]) == (1, newest["seq"], newest["step"])
    retry = got["retry"]
    assert "error_type" not in retry, retry.get("message")
    assert retry["result"]["start"] == newest["step"] + 1
    assert retry["final_step"] == newest["step"] + 2  # it trained on: steps newest + 1 and newest + 2
    assert retry["leftovers"] == {}


def test_a_host_lost_mid_training_costs_one_restart_of_the_same_run_on_the_capacity_left(netbed, bed_runs):
    got = run_of(bed_runs, "host-lost")
    killed = got["killed"]
    assert killed["processes"] > 0
    assert "error_type" not in got, got.get("message")
    lost, restarted = got["attempts"]
    assert (lost["ending"], restarted["ending"]) == ("lost", "success")
    assert killed["host"] in lost["cause"]  # the lost task's executor, on the host that died
    assert restarted["resumed_from"]["step"] >= killed["newest_step"] >= 3
    assert got["result"] == {"start": restarted["resumed_from"]["step"] + 1, "attempt": 1, "size": 2}
    first, second = got["plans"]
    survivor = {h.address for h in netbed.workers} - {killed["host"]}
    assert {slot["address"] for slot in first} == {h.address for h in netbed.workers}
    assert {slot["address"] for slot in second} == survivor  # both ranks on the host left, its two slots
    assert got["leftovers"] == {} and not any(got["survivor_leftovers"].values())
