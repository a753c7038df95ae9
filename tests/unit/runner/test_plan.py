from __future__ import annotations

import pytest

from airflow_provider_horovod.runner.plan import TaskFacts, host_assignments, make_plan, rank_env
from tests.plans import task_facts


def facts(partition: int, executor: str, gpus: tuple[str, ...] = ()) -> TaskFacts:
    return task_facts(partition, executor, gpus=gpus)


def test_partition_zero_is_rank_zero_and_ranks_are_contiguous_per_host():
    # Spark may place partitions on executors in any order.
    plan = make_plan([facts(3, "b:1"), facts(0, "a:1"), facts(1, "b:1"), facts(2, "a:1")])
    assert [(s.rank, s.partition, s.hostname) for s in plan.slots] == [
        (0, 0, "hvdhost0"), (1, 2, "hvdhost0"), (2, 1, "hvdhost1"), (3, 3, "hvdhost1"),
    ]
    assert [name for name, _ in plan.hosts] == ["hvdhost0", "hvdhost1"]


def test_local_and_cross_ranks_match_horovod_for_uneven_hosts():
    plan = make_plan([facts(0, "a:1"), facts(1, "a:1"), facts(2, "a:1"), facts(3, "b:1")])
    layout = [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in plan.slots]
    # Horovod's get_host_assignments: local rank 0 exists on both hosts, 1 and 2 only on host a.
    assert layout == [(0, 0, 3, 0, 2), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1), (3, 0, 1, 1, 2)]


def gloo_slot_env(slot):
    from airflow_provider_horovod.runner.launchers import gloo
    from tests.unit.runner.task.test_host import spec

    return gloo.slot_env(spec("gloo"), slot, ("10.0.0.1", 4242))


def test_rank_env_under_gloo_carries_the_horovod_contract_and_exactly_the_tasks_gpus():
    plan = make_plan([facts(0, "a:1", gpus=("3",)), facts(1, "b:1", gpus=("0", "1"))])
    env0, env1 = gloo_slot_env(plan.slots[0]), gloo_slot_env(plan.slots[1])
    assert env0["HOROVOD_RANK"] == "0" and env1["HOROVOD_RANK"] == "1"
    assert env0["HOROVOD_SIZE"] == env1["HOROVOD_SIZE"] == "2"
    assert env1["HOROVOD_CROSS_RANK"] == "1" and env1["HOROVOD_HOSTNAME"] == "hvdhost1"
    assert rank_env(plan.slots[0])["CUDA_VISIBLE_DEVICES"] == "3" and rank_env(plan.slots[1])["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(make_plan([facts(0, "a:1")]).slots[0])


def test_rank_env_under_mpirun_leaves_the_ranks_to_mpi_as_horovodrun_does():
    plan = make_plan([facts(0, "a:1", gpus=("3",)), facts(1, "b:1")])
    env0, env1 = rank_env(plan.slots[0]), rank_env(plan.slots[1])  # mpirun adds no slot_env of its own
    assert not [k for k in {**env0, **env1} if k.startswith("HOROVOD_")]
    assert env1["HVDRUNNER_RANK"] == "1" and env1["HVDRUNNER_CROSS_RANK"] == "1"  # for runtime.rank() & co
    assert env0["CUDA_VISIBLE_DEVICES"] == "3" and "CUDA_VISIBLE_DEVICES" not in env1


def test_gloo_env_points_at_the_rendezvous_server_with_the_runs_token():
    from airflow_provider_horovod.runner import wire
    from tests.unit.runner.task.test_host import spec

    env = gloo_slot_env(make_plan([facts(0, "a:1")]).slots[0])
    token = wire.rendezvous_token(spec("gloo").secret)
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1:4242/%s" % token  # Horovod's URL: http://ADDR:PORT/<scope>/...
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"


@pytest.mark.parametrize("layout", [[1], [2], [3, 1], [1, 3], [2, 2, 1], [1, 2, 3], [4, 4]])
def test_host_assignments_are_horovods_own(layout):
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    hosts = [("hvdhost%d" % i, n) for i, n in enumerate(layout)]
    theirs = get_host_assignments([HostInfo(name, n) for name, n in hosts], sum(layout))
    assert host_assignments(hosts) == [{k: getattr(info, k) for k in host_assignments(hosts)[0]} for info in theirs]


def test_torch_env_is_torchruns_contract_on_the_plans_interface():
    from dataclasses import replace

    from airflow_provider_horovod.runner.launchers import torch as torch_launcher

    plan = make_plan([replace(facts(0, "a:1"), iface="eth0"), replace(facts(1, "a:1"), iface="eth0"),
                      replace(facts(2, "b:1"), iface="ens5")])
    envs = [torch_launcher.slot_env(plan, s, "run1", ("10.0.0.0", 29500), {}) for s in plan.slots]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.0", "29500")}
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [("0", "2", "0"), ("1", "2", "0"), ("0", "1", "1")]
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"} and {e["TORCHELASTIC_RUN_ID"] for e in envs} == {"run1"}
    assert [e["ROLE_RANK"] for e in envs] == ["0", "1", "2"] and {e["ROLE_WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["GLOO_SOCKET_IFNAME"] for e in envs] == ["eth0", "eth0", "ens5"] == [e["NCCL_SOCKET_IFNAME"] for e in envs]
    assert [e.get("OMP_NUM_THREADS") for e in envs] == ["1", "1", None]  # as torchrun: several ranks share a host's CPUs
    assert "OMP_NUM_THREADS" not in torch_launcher.slot_env(plan, plan.slots[0], "r", ("a", 1), {"OMP_NUM_THREADS": "4"})
    assert not [k for e in envs for k in e if k.startswith("HOROVOD_")]
    # torchrun's agent hosts the store; here rank 0's process does, before the training function
    assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in envs} == {"True"}
    assert {e["HVDRUNNER_BEFORE_MAIN"] for e in envs} == {"airflow_provider_horovod.runner.launchers.torch:before_main"}
    # attempt 0 of a run without restarts, as a first torchrun start; a restart counts as torchrun counts its own
    assert {(e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) for e in envs} == {("0", "0")}
    again = torch_launcher.slot_env(plan, plan.slots[1], "run1", ("10.0.0.0", 29500), {}, attempt=2, max_restarts=3)
    assert (again["TORCHELASTIC_RESTART_COUNT"], again["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")


def test_torch_ranks_given_gpus_are_nodes_of_one_so_local_rank_names_their_own_gpu():
    from airflow_provider_horovod.runner.launchers import torch as torch_launcher

    plan = make_plan([facts(0, "a:1", gpus=("3",)), facts(1, "a:1", gpus=("5",))])
    envs = [torch_launcher.slot_env(plan, s, "r", ("10.0.0.0", 1), {}) for s in plan.slots]
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs] == [
        ("0", "1", "0", "2"), ("0", "1", "1", "2")]
    assert [rank_env(s)["CUDA_VISIBLE_DEVICES"] for s in plan.slots] == ["3", "5"]


def test_plan_round_trips_through_json():
    plan = make_plan([facts(0, "a:1", gpus=("0",)), facts(1, "a:1", gpus=("1",))])
    from airflow_provider_horovod.runner.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan
    f = facts(1, "b:2", gpus=("7",))
    assert TaskFacts.from_json(f.to_json()) == f


def test_empty_plan_is_refused():
    with pytest.raises(ValueError):
        make_plan([])


def test_mpirun_selects_interfaces_by_network_not_by_the_name_each_host_gives_its_nic():
    from dataclasses import replace

    from airflow_provider_horovod.runner.launchers.mpirun import mpirun_argv

    a = replace(facts(0, "a:1"), iface="eth0", network="10.0.3.0/24")
    b = replace(facts(1, "b:1"), iface="ens5", network="10.0.3.0/24")
    c = replace(facts(2, "c:1"), iface="enp7s0", network="10.0.4.0/24")  # a host on a routed neighbour subnet
    plan = make_plan([a, b, c])
    assert plan.networks == ["10.0.3.0/24", "10.0.4.0/24"]
    argv = mpirun_argv(plan, agent="/x/agent", networks=plan.networks)
    pairs = {argv[i + 1]: argv[i + 2] for i, word in enumerate(argv) if word == "-mca"}
    assert pairs["btl_tcp_if_include"] == pairs["oob_tcp_if_include"] == "10.0.3.0/24,10.0.4.0/24"
    assert not {"eth0", "ens5", "enp7s0"} & set(argv)


def test_network_of_an_address_is_its_interfaces_cidr():
    from airflow_provider_horovod.runner.network import endpoint_of

    assert endpoint_of("127.0.0.1").network == "127.0.0.0/8"
    assert endpoint_of("192.0.2.77").network == ""  # held by no interface here (TEST-NET-1)
