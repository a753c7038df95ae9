"""Horovod's Gloo rendezvous answers only the plan's hosts and serves no files. Finding 4 of issue #10."""

from __future__ import annotations

import http.client
import os

import pytest

from airflow_provider_horovod.runner.gloo import Rendezvous
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan

PLAN_HOST = "127.0.0.2"  # the plan's task address; the attacker connects from 127.0.0.1 (all of 127/8 is local)


@pytest.fixture
def rendezvous(tmp_path):
    (tmp_path / "notes.txt").write_text("a file in the working directory")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # SimpleHTTPRequestHandler, which Horovod's handler extends, serves the working directory
    server = Rendezvous("127.0.0.1")
    facts = [TaskFacts(partition=p, executor="e%d" % p, address=PLAN_HOST, pid=1, task_dir="/x", python="3.11")
             for p in range(2)]
    server.init(make_plan(facts))
    try:
        yield server
    finally:
        server.stop()
        os.chdir(cwd)


def _request(server: Rendezvous, method: str, path: str, body: bytes | None = None, source: str = PLAN_HOST):
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
    server = Rendezvous("127.0.0.1")
    try:
        assert _request(server, "PUT", "/global/rank_0", b"x", source="127.0.0.1")[0] is None
    finally:
        server.stop()
