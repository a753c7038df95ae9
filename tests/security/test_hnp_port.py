"""Finding N11 of issue #21 (and its residual in issue 40: the URIs must be exactly mpirun's): an
exec service starts ``orted`` only towards mpirun's own HNP ports, which partition 0 holds for it and
names in its facts (the plan pins them), not just towards partition 0's address.

Partition 0 holds several ports, released just before mpirun binds: a port taken by another
process in that moment (CI, under load: mpirun named no port at all and every orted was refused)
leaves mpirun the others, and its URI names only those."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from airflow_provider_horovod.runner.launchers.mpirun import (HNP_PORT_OPTION, OrtedRefused, agent_command, check_orted, mpirun_argv,
                                                 orted_argv, shell_status, without_hnp_port)
from airflow_provider_horovod.runner.plan import Plan
from tests.plans import loopback_plan

HNP_PORTS = (41234, 41236, 41238)


def _plan(tmp_path, hnp_ports=HNP_PORTS) -> Plan:
    return loopback_plan([tmp_path, tmp_path], hnp_ports=hnp_ports)


def _orted_line(plan: Plan, hnp_uri: str) -> list[str]:
    """The orted line mpirun hands the agent for the second host: mpirun's own -mca options, then Open MPI's."""
    ours = mpirun_argv(plan, agent=agent_command(), networks=plan.networks)
    line = ["orted"]
    for i, word in enumerate(ours):
        if word == "-mca":
            line += ["-mca", ours[i + 1], ours[i + 2]]
    return line + ["-mca", "ess", "env", "-mca", "ess_base_jobid", "4242", "-mca", "ess_base_vpid", "2",
                   "-mca", "ess_base_num_procs", "3", "-mca", "orte_hnp_uri", hnp_uri, "-mca", "plm", "rsh"]


def test_mpirun_is_told_the_ports_its_orteds_will_be_pointed_at(tmp_path):
    argv = mpirun_argv(_plan(tmp_path), networks=["127.0.0.0/8"])
    assert argv[argv.index(HNP_PORT_OPTION) + 1] == "41234,41236,41238"


@pytest.mark.parametrize("ports", ["41234,41236,41238", "41236,41238", "41238"])
def test_an_orted_pointed_at_mpiruns_ports_passes_and_starts_without_the_port_option(tmp_path, ports):
    plan = _plan(tmp_path)
    line = _orted_line(plan, "4242.0;tcp://127.0.0.1:%s" % ports)
    check_orted(line, plan, {}, vpid=2)
    assert HNP_PORT_OPTION not in without_hnp_port(line)  # this host's orted picks a port of its own
    assert len(without_hnp_port(line)) == len(line) - 3


@pytest.mark.parametrize("uri", [
    "4242.0;tcp://127.0.0.1:41235",  # partition 0's address, another port: a fake HNP there
    "4242.0;tcp://127.0.0.1:41234,41235",  # a held port beside one that is not
    "4242.0;tcp://127.0.0.1:41235;tcp6://[::1]:41234",
    # issue 40 (N11's residual): after the genuine URI, further loopback URIs with any port
    "4242.0;tcp://127.0.0.1:41234;tcp://127.0.0.1:41235",
    "4242.0;tcp://127.0.0.1:41234;tcp6://[::1]:41235",
    "4242.0;tcp://127.0.0.1,127.0.0.2:41234",
    "4242.0;tcp://127.0.0.1:",  # what mpirun writes when it could bind none of its ports
])
def test_an_orted_pointed_at_another_port_of_partition_0s_host_is_refused(tmp_path, uri):
    plan = _plan(tmp_path)
    with pytest.raises(OrtedRefused, match="orte_hnp_uri"):
        check_orted(_orted_line(plan, uri), plan, {}, vpid=2)


def _free_ports(n: int) -> list[int]:
    holds = [socket.socket() for _ in range(n)]
    for hold in holds:
        hold.bind(("", 0))
    ports = [hold.getsockname()[1] for hold in holds]
    for hold in holds:
        hold.close()
    return ports


def test_real_mpirun_with_a_held_port_taken_by_another_process_still_points_its_orteds_at_its_own(tmp_path):
    """The race itself, with Open MPI's own behaviour: another process listens on the first port
    partition 0 released; mpirun's orted lines name the other two, and pass the check."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = (taken.getsockname()[1], *_free_ports(2))
    plan = _plan(tmp_path, hnp_ports=ports)
    lines = tmp_path / "agent.jsonl"
    agent = tmp_path / "agent.py"  # in mpirun's place of our rsh agent: it writes down what it was asked, starts nothing
    agent.write_text("#!%s\nimport json, sys\nopen(%r, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\nsys.exit(1)\n"
                     % (sys.executable, str(lines)))
    agent.chmod(0o755)
    argv = mpirun_argv(plan, agent=str(agent), networks=plan.networks)
    with taken:
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=120).returncode
    mca_env = {k: v for k, v in os.environ.items() if k.startswith("OMPI_MCA_")}  # mpirun passes them on too
    assert code != 0  # no orted started: mpirun gave up, as asked
    asked = [orted_argv(json.loads(line)[1:]) for line in lines.read_text().splitlines()]
    assert asked, "mpirun never ran the agent"
    for line in asked:
        uri = line[line.index("orte_hnp_uri") + 1]
        assert uri.endswith("tcp://127.0.0.1:%d,%d" % ports[1:])
        check_orted(line, plan, mca_env, agent=str(agent))


@pytest.mark.parametrize("code,status", [(0, 0), (1, 1), (255, 255), (137, -9), (143, -15)])
def test_mpiruns_exit_code_reads_as_a_signal_only_in_a_shells_range(code, status):
    assert shell_status(code) == status  # 255 is mpirun's own failure, never "killed by signal 127"
