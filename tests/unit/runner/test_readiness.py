"""Plan-time readiness: each host's /dev/shm, as its barrier task reports it, warned about or refused
before any rank starts; hosts told apart by executor, never by their (repeatable) names."""

from __future__ import annotations

import logging

import pytest

from airflow_provider_horovod.runner.driver.attempt import checked_plan
from airflow_provider_horovod.runner.driver.supervisor import PlanError
from airflow_provider_horovod.runner.readiness import MIB, shm_of_this_host
from tests.plans import task_facts

GIB = 1024 * MIB
DRIVER_STACK: dict[str, str] = {}


def plan_of(*facts):
    return checked_plan("3.11.2", DRIVER_STACK, list(facts))


def test_a_host_with_dockers_64_mib_dev_shm_is_warned_about_naming_it_its_address_the_size_and_the_fix(caplog):
    caplog.set_level(logging.WARNING)
    plan_of(task_facts(0, "10.1.0.2:4001", machine="trainer-0", shm_size=8 * GIB, shm_free=8 * GIB),
            task_facts(1, "10.1.0.3:4001", address="10.1.0.3", machine="trainer-1", shm_size=64 * MIB, shm_free=60 * MIB))
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("/dev/shm on host trainer-1 (executor 10.1.0.3:4001, address 10.1.0.3) is 64 MiB for 1 "
                              "rank(s), below the 512 MiB this provider asks per rank")
    assert "--shm-size=8g" in warning and "medium: Memory" in warning and "No space left on device" in warning


def test_two_hosts_with_the_same_name_stay_two_hosts_and_each_is_named_by_its_executor(caplog):
    caplog.set_level(logging.WARNING)
    plan = plan_of(*(task_facts(p, "10.1.0.%d:4001" % (2 + p // 2), machine="trainer-0", shm_size=64 * MIB,
                                shm_free=64 * MIB) for p in range(4)))
    assert [(s.hostname, s.local_rank, s.cross_rank) for s in plan.slots] == [
        ("hvdhost0", 0, 0), ("hvdhost0", 1, 0), ("hvdhost1", 0, 1), ("hvdhost1", 1, 1)]
    warnings = [r.getMessage() for r in caplog.records]
    assert [w.split(" is ")[0] for w in warnings] == [
        "/dev/shm on host trainer-0 (executor 10.1.0.2:4001, address 10.0.0.0)",
        "/dev/shm on host trainer-0 (executor 10.1.0.3:4001, address 10.0.0.2)"]
    assert all("for 2 rank(s)" in w for w in warnings)


def test_a_full_dev_shm_is_refused_before_any_rank_starts(caplog):
    with pytest.raises(PlanError) as err:
        plan_of(task_facts(0, "10.1.0.2:4001", machine="trainer-0", shm_size=64 * MIB, shm_free=200 * 1024),
                task_facts(1, "10.1.0.3:4001"))
    assert err.value.failure.message.startswith(
        "/dev/shm on host trainer-0 (executor 10.1.0.2:4001, address 10.0.0.0) is full (0.195 MiB free of 64 MiB)")
    assert "--shm-size" in err.value.failure.message


def test_enough_dev_shm_or_none_reported_says_nothing(caplog):
    caplog.set_level(logging.WARNING)
    plan_of(task_facts(0, "a:1", shm_size=2 * GIB, shm_free=GIB), task_facts(1, "a:1", shm_size=2 * GIB, shm_free=GIB),
            task_facts(2, "b:1"))  # -1: a task that did not say (an older executor), or no /dev/shm at all
    assert caplog.records == []


def test_a_task_reads_its_hosts_dev_shm(tmp_path):
    size, free = shm_of_this_host()
    assert size > 0 and 0 <= free <= size  # this machine's
    assert shm_of_this_host(str(tmp_path / "none")) == (-1, -1)
