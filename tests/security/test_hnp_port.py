"""Finding N11 of issue #21 (and its residual in issue 40: the URIs must be exactly mpirun's): an exec service starts ``orted`` only towards mpirun's own HNP port,
which partition 0 holds for it and names in its facts (the plan pins it), not just towards
partition 0's address. Pure checks of the orted line: no mpirun needed."""

from __future__ import annotations


import pytest

from airflow_provider_horovod.runner.launchers.mpirun import (HNP_PORT_OPTION, OrtedRefused, agent_command, check_orted, mpirun_argv,
                                                 without_hnp_port)
from airflow_provider_horovod.runner.plan import Plan
from tests.plans import loopback_plan

HNP_PORT = 41234


def _plan(tmp_path) -> Plan:
    return loopback_plan([tmp_path, tmp_path], hnp_port=HNP_PORT)


def _orted_line(plan: Plan, hnp_uri: str) -> list[str]:
    """The orted line mpirun hands the agent for the second host: mpirun's own -mca options, then Open MPI's."""
    ours = mpirun_argv(plan, agent=agent_command(), networks=plan.networks)
    line = ["orted"]
    for i, word in enumerate(ours):
        if word == "-mca":
            line += ["-mca", ours[i + 1], ours[i + 2]]
    return line + ["-mca", "ess", "env", "-mca", "ess_base_jobid", "4242", "-mca", "ess_base_vpid", "2",
                   "-mca", "ess_base_num_procs", "3", "-mca", "orte_hnp_uri", hnp_uri, "-mca", "plm", "rsh"]


def test_mpirun_is_told_the_port_its_orteds_will_be_pointed_at(tmp_path):
    argv = mpirun_argv(_plan(tmp_path), networks=["127.0.0.0/8"])
    assert argv[argv.index(HNP_PORT_OPTION) + 1] == str(HNP_PORT)


def test_an_orted_pointed_at_mpiruns_port_passes_and_starts_without_the_port_option(tmp_path):
    plan = _plan(tmp_path)
    line = _orted_line(plan, "4242.0;tcp://127.0.0.1:%d" % HNP_PORT)
    check_orted(line, plan, {}, vpid=2)
    assert HNP_PORT_OPTION not in without_hnp_port(line)  # this host's orted picks a port of its own
    assert len(without_hnp_port(line)) == len(line) - 3


@pytest.mark.parametrize("uri", [
    "4242.0;tcp://127.0.0.1:%d" % (HNP_PORT + 1),  # partition 0's address, another port: a fake HNP there
    "4242.0;tcp://127.0.0.1:%d;tcp6://[::1]:%d" % (HNP_PORT + 1, HNP_PORT),
    # issue 40 (N11's residual): after the genuine URI, further loopback URIs with any port
    "4242.0;tcp://127.0.0.1:%d;tcp://127.0.0.1:%d" % (HNP_PORT, HNP_PORT + 1),
    "4242.0;tcp://127.0.0.1:%d;tcp6://[::1]:%d" % (HNP_PORT, HNP_PORT + 1),
    "4242.0;tcp://127.0.0.1,127.0.0.2:%d" % HNP_PORT,
])
def test_an_orted_pointed_at_another_port_of_partition_0s_host_is_refused(tmp_path, uri):
    plan = _plan(tmp_path)
    with pytest.raises(OrtedRefused, match="orte_hnp_uri"):
        check_orted(_orted_line(plan, uri), plan, {}, vpid=2)
