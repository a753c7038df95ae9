"""The engine across hosts whose own names resolve to loopback, as on Debian (``127.0.1.1 <hostname>``
in ``/etc/hosts``): the bed of ``test_hosts.py`` with ``NetBed(loopback_names=True)``, Spark's
workers started by host name. Both launchers run here. Every task reports its real address and
interface (the plan has them, ``HOROVOD_GLOO_IFACE`` names the NIC); unpatched, Horovod 0.28's
``GlooContext::InitializeForProcessSet`` (gloo_context.cc) makes its device from its own, never set
``gloo_iface_`` instead of the global context's, so a Gloo rank advertised the address of
``gethostname()`` and its peer died with ``gloo::IoException ... connect [127.0.1.1]:...:
Connection refused``. The Horovod builder patches that line (``airflow_provider_horovod/builder.py``).
"""

from __future__ import annotations

import pytest

from tests.integration.netbed import BedCluster, NetBed
from tests.integration.test_hosts import assert_torch_ran_across_the_hosts, hosts_of, run_of

pytestmark = pytest.mark.slow
SCENARIO_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def netbed():
    why = NetBed.unavailable()
    if why is not None:
        pytest.skip(why)
    bed = NetBed(workers=2, loopback_names=True)
    try:
        yield bed.up()
    finally:
        bed.down()
        assert bed.leftovers() == []


@pytest.fixture(scope="module")
def bed_runs(netbed, tmp_path_factory):
    cluster = BedCluster(netbed, tmp_path_factory.mktemp("bed-spark-logs"), cores=2)
    try:
        cluster.start()
        return cluster.run_scenarios(tmp_path_factory.mktemp("bed-out") / "runs.json", ["mpirun-2", "gloo-2", "torch-2"],
                                     SCENARIO_TIMEOUT_S)
    finally:
        cluster.stop()


def test_each_worker_hosts_own_name_resolves_to_loopback(netbed):
    for host in netbed.workers:
        resolved = netbed.run(host, ["getent", "hosts", host.hostname], capture_output=True, text=True)
        assert resolved.stdout.split()[:1] == ["127.0.1.1"], resolved.stdout


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_ranks_on_hosts_whose_names_resolve_to_loopback_reach_each_other(netbed, bed_runs, launcher):
    got = run_of(bed_runs, "%s-2" % launcher)
    assert "error_type" not in got, got.get("message")
    result = got["result"]["layout"]  # the run reads a dataset= too (test_hosts.py asserts on it)
    assert result["sum"] == 3.0
    layout = [(r["rank"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in result["ranks"]]
    assert layout == [(0, 0, 1, 0, 2), (1, 0, 1, 1, 2)]
    assert set(hosts_of(got["plan"])) == {h.address for h in netbed.workers}  # never 127.0.1.1
    assert {slot["iface"] for slot in got["plan"]} == {h.iface for h in netbed.workers}
    assert got["leftovers"] == {}


def test_torch_ranks_on_hosts_whose_names_resolve_to_loopback_reach_each_other(netbed, bed_runs):
    assert_torch_ran_across_the_hosts(netbed, run_of(bed_runs, "torch-2"))
