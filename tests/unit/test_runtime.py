"""``runtime.device()``: the rank's own device, as Spark gave it, under every launcher."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner.plan import make_plan, rank_env
from tests.plans import task_facts


@pytest.fixture
def in_rank(monkeypatch):
    """Set the environment the rank process of ``slot`` gets (``runner.rank.worker`` applies ``rank_env``)."""
    for name in ("CUDA_VISIBLE_DEVICES", "HVDRUNNER_GPUS", "HVDRUNNER_LOCAL_RANK", "HOROVOD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def enter(slot) -> None:
        for name, value in rank_env(slot).items():
            monkeypatch.setenv(name, value)

    return enter


def test_a_rank_whose_task_got_one_gpu_uses_cuda_0_whatever_its_local_rank(in_rank):
    # two tasks of one executor, each given one GPU: the second is local rank 1 but sees one device
    plan = make_plan([task_facts(0, "e:1", gpus=("0",)), task_facts(1, "e:1", gpus=("1",))])
    in_rank(plan.slots[1])
    assert runtime.local_rank() == 1  # set_device(local_rank) would ask for a device it cannot see
    assert (runtime.device(), runtime.device("tensorflow")) == ("cuda:0", "/GPU:0")


def test_a_rank_whose_task_got_several_gpus_uses_the_first_of_them(in_rank):
    plan = make_plan([task_facts(0, "e:1", gpus=("6", "7"))])
    in_rank(plan.slots[0])
    assert runtime.device() == "cuda:0"  # CUDA_VISIBLE_DEVICES=6,7: cuda:0 is the machine's GPU 6


def test_without_spark_gpus_a_rank_maps_its_local_rank_onto_the_gpus_it_sees(in_rank, monkeypatch):
    plan = make_plan([task_facts(p, "e:1") for p in range(4)])
    in_rank(plan.slots[3])
    monkeypatch.setattr(runtime, "_visible_gpus", lambda framework: 2)  # a machine with two GPUs Spark does not manage
    assert (runtime.device(), runtime.device("tensorflow")) == ("cuda:1", "/GPU:1")


def test_without_any_gpu_the_device_is_the_cpu(in_rank):
    in_rank(make_plan([task_facts(0, "e:1")]).slots[0])
    assert runtime.device() == "cpu"  # torch here sees no GPU


def test_an_unknown_framework_is_refused():
    with pytest.raises(ValueError, match="framework must be 'torch' or 'tensorflow'"):
        runtime.device("jax")
