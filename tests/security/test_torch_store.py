"""Findings T5-1 and T5-2 of issue 49: torch's store under ``launcher="torch"``.

T5-1: rank 0's ``TCPStore`` bound every address of its host whatever ``MASTER_ADDR`` said, also
for ``np < 0``, where every other endpoint of a run stays on loopback. T5-2: the task held
``MASTER_PORT`` bound with ``SO_REUSEADDR`` and never listening, so another local user bound and
listened on it first; with ``TORCHELASTIC_USE_AGENT_STORE`` in rank 0's environment torch ignored its
own failed bind and every rank joined the squatter's store. Now the task binds the plan's address
only and listens from its start, and hands that socket to rank 0's store (``launchers/torch.py``
``PortHold``, ``host_store``): nobody else can take the port, no other address reaches it, and a
rank 0 without that socket fails instead of becoming a client."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import socket
import subprocess
import sys

import psutil
import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.runner.launchers.torch import AGENT_STORE_ENV, PortHold
from tests.security import rank_jobs
from tests.security.attacker import settle

# Another local user: bind the port on each address given (SO_REUSEADDR, as a squatter would) and listen.
_SQUAT = """
import socket, sys
port = int(sys.argv[1])
for address in sys.argv[2:]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen()
        print(address, "listening", flush=True)
    except OSError as err:
        print(address, err.errno, flush=True)
"""


def _as_nobody(code: str, *args: str, **kwargs) -> subprocess.Popen:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # one that nobody may run
    return subprocess.Popen([python, "-I", "-c", code, *args], user=65534, group=65534, cwd="/", text=True,
                            stdout=subprocess.PIPE, **kwargs)


def test_another_local_user_can_neither_bind_nor_listen_on_the_held_master_port():
    hold = PortHold("127.0.0.1")
    try:
        squatter = _as_nobody(_SQUAT, str(hold.port), "127.0.0.1", "0.0.0.0")
        out, _ = squatter.communicate(timeout=30)
    finally:
        hold.close()
    assert out.splitlines() == ["127.0.0.1 %d" % errno.EADDRINUSE, "0.0.0.0 %d" % errno.EADDRINUSE]


def _listening_as_nobody() -> tuple[subprocess.Popen, int]:
    """A process of ``nobody`` listening on a free loopback port, saying "connected" for each connection."""
    code = ("import socket\nserver = socket.create_server(('127.0.0.1', 0))\nprint(server.getsockname()[1], flush=True)\n"
            "while True:\n    conn, _ = server.accept()\n    print('connected', flush=True)\n    conn.close()\n")
    proc = _as_nobody(code)
    return proc, int(proc.stdout.readline())


def test_rank_0_without_the_tasks_socket_fails_instead_of_joining_whoever_listens_on_master_port(tmp_path):
    """Rank 0 as the runner starts it (``TORCHELASTIC_USE_AGENT_STORE=True``), the port another user's: torch
    used to log "failed to bind ... ignoring the error" and make rank 0 a client of that user's store."""
    squatter, port = _listening_as_nobody()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2",
               **{AGENT_STORE_ENV: "True"})
    env.pop("HVDRUNNER_STORE_FD", None)
    code = "from airflow_provider_horovod.runner.launchers import torch as t; t.before_main()"
    try:
        rank0 = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    finally:
        squatter.kill()
        told, _ = squatter.communicate()
    assert rank0.returncode != 0
    assert "TorchStoreError: Rank 0 has no listening socket for torch.distributed's store at 127.0.0.1:%d" % port \
        in rank0.stderr
    assert "connected" not in told  # it never reached the squatter


def _other_addresses_of_this_host() -> list[str]:
    """127.0.0.2 (a socket on the wildcard answers it, one on 127.0.0.1 does not) and every IPv4
    address of this host's other interfaces, as a peer on their networks would connect."""
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return ["127.0.0.2", *others]


def _ranks_listening() -> set[tuple[str, int]]:
    """Every address and port a rank process of this test listens on (its store, Gloo's pairs)."""
    listening, ranks = set(), 0
    for proc in psutil.Process().children(recursive=True):
        try:  # a child that ended meanwhile (a zombie not yet reaped, or gone) listens on nothing
            if "airflow_provider_horovod.runner.rank.worker" not in " ".join(proc.cmdline()):
                continue
            connections = proc.net_connections("inet")
        except psutil.Error:
            continue
        ranks += 1
        listening |= {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}
    assert ranks, "no rank process found"
    return listening


def _reaches(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_the_store_of_a_torch_run_on_the_driver_answers_on_loopback_only(tmp_path):
    """``np < 0``: while both ranks are in their process group, the store answers on 127.0.0.1 and
    on no other address of this host (a network peer connected to eth0's address and wrote keys),
    and nothing else the ranks listen on is off loopback either."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(HorovodRunner(-2, launcher="torch").run, rank_jobs.torch_store_job, str(tmp_path))
        try:
            assert settle(lambda: (tmp_path / "port").exists() or run.done(), timeout=300), "rank 0 never wrote its port"
            port = int((tmp_path / "port").read_text())
            reached = {address: _reaches(address, port) for address in ["127.0.0.1", *_other_addresses_of_this_host()]}
            listening = _ranks_listening()
        finally:
            (tmp_path / "probed").touch()
        assert run.result(timeout=300) == 2
    assert reached == {"127.0.0.1": True, **{address: False for address in _other_addresses_of_this_host()}}
    assert ("127.0.0.1", port) in listening  # rank 0 serves on the socket its task handed it
    assert {address for address, _ in listening} == {"127.0.0.1"}  # nor do Gloo's pairs listen anywhere else
