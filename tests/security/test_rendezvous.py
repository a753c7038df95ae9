"""Horovod's Gloo rendezvous answers only the plan's hosts, only requests that carry the run's token,
and serves no files. Finding 4 of issue #10, and the same-host rendezvous of issue #21."""

from __future__ import annotations

import http.client
import os

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.launchers.gloo import Rendezvous
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan
from tests.security.attacker import SECRET

PLAN_HOST = "127.0.0.2"  # the plan's task address; the attacker connects from 127.0.0.1 (all of 127/8 is local)


@pytest.fixture
def rendezvous(tmp_path):
    (tmp_path / "notes.txt").write_text("a file in the working directory")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # SimpleHTTPRequestHandler, which Horovod's handler extends, serves the working directory
    server = Rendezvous("127.0.0.1", SECRET)
    facts = [TaskFacts(partition=p, executor="e%d" % p, address=PLAN_HOST, pid=1, task_dir="/x", python="3.11")
             for p in range(2)]
    server.init(make_plan(facts))
    try:
        yield server
    finally:
        server.stop()
        os.chdir(cwd)


def _request(server: Rendezvous, method: str, path: str, body: bytes | None = None, source: str = PLAN_HOST,
             token: str | None = None):
    """A request as a rank sends it: Horovod's client puts the ADDR it is given (with the token) before the path."""
    path = "/%s:%d%s" % (wire.rendezvous_token(SECRET) if token is None else token, server.port, path)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5, source_address=(source, 0))
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    except (ConnectionError, http.client.RemoteDisconnected):
        return None, b""
    finally:
        conn.close()


def test_the_plans_hosts_can_rendezvous(rendezvous):
    assert _request(rendezvous, "PUT", "/global/rank_0", b"10.0.0.1:1234")[0] == 200
    assert _request(rendezvous, "GET", "/global/rank_0") == (200, b"10.0.0.1:1234")


def test_a_foreign_address_cannot_write_read_or_delete_entries(rendezvous):
    assert _request(rendezvous, "PUT", "/global/rank_0", b"10.0.0.1:1234")[0] == 200
    for method, body in (("PUT", b"attacker:1"), ("GET", None), ("DELETE", None)):
        assert _request(rendezvous, method, "/global/rank_0", body, source="127.0.0.1")[0] is None
    assert _request(rendezvous, "GET", "/global/rank_0") == (200, b"10.0.0.1:1234")
    assert rendezvous.refused == 3


def test_no_file_is_served_and_other_methods_are_refused(rendezvous):
    status, body = _request(rendezvous, "HEAD", "/notes.txt")
    assert status == 405
    for method in ("POST", "OPTIONS", "TRACE"):
        assert _request(rendezvous, method, "/notes.txt")[0] == 501
    assert b"a file in the working directory" not in _request(rendezvous, "GET", "/notes.txt")[1]


def test_before_the_plan_nobody_is_answered():
    server = Rendezvous("127.0.0.1", SECRET)
    try:
        assert _request(server, "PUT", "/global/rank_0", b"x", source="127.0.0.1")[0] is None
    finally:
        server.stop()



_AS_ANOTHER_USER = """
import http.client, sys
for path in sys.argv[2:]:
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=5)
    conn.request("PUT", path, body=b"attacker:1")
    response = conn.getresponse()
    response.read()
    print(response.status)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user (nobody) needs root")
def test_another_local_user_on_a_plan_host_cannot_write_a_rendezvous_entry():
    """On a host of the plan (here every rank is on 127.0.0.1) the allow-list by address admits every
    local user; the run's token in the path is what keeps them out (a process of ``nobody`` here)."""
    import shutil
    import subprocess
    import sys

    server = Rendezvous("127.0.0.1", SECRET)
    facts = [TaskFacts(partition=p, executor="driver", address="127.0.0.1", pid=1, task_dir="/x", python="3.11")
             for p in range(2)]
    server.init(make_plan(facts))
    guesses = ["/global/rank_0", "/%s:%d/global/rank_0" % ("0" * 32, server.port)]
    try:
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # one that nobody may run
        done = subprocess.run([python, "-I", "-c", _AS_ANOTHER_USER, str(server.port), *guesses], user=65534,
                              group=65534, capture_output=True, text=True, timeout=30, cwd="/")
        assert done.stdout.split() == ["403", "403"], done.stderr
        assert _request(server, "GET", "/global/rank_0", source="127.0.0.1")[0] != 200  # nothing was written
        assert _request(server, "PUT", "/global/rank_0", b"10.0.0.1:1", source="127.0.0.1")[0] == 200  # a rank may
    finally:
        server.stop()
