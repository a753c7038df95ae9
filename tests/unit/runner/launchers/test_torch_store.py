"""Torch's store under ``launcher="torch"`` (``launchers/torch.py`` ``before_main``): rank 0 starts it
before the training function, on the socket its task holds (``PortHold``); the other ranks wait until
it answers, and say so when it never does."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from airflow_provider_horovod.exceptions import TorchStoreError
from airflow_provider_horovod.runner.launchers import torch as torch_launcher


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(monkeypatch, rank: int, port: int) -> None:
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                        "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)


def test_a_rank_waits_for_rank_0s_store_and_goes_on_once_it_listens(monkeypatch):
    import torch.distributed as dist

    port = _free_port()
    _rank_env(monkeypatch, 1, port)
    stores = []

    def listen_later() -> None:
        time.sleep(0.5)
        stores.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False))

    threading.Thread(target=listen_later, daemon=True).start()
    started = time.monotonic()
    torch_launcher.before_main()
    waited = time.monotonic() - started
    assert 0.4 < waited < 5.0
    assert stores[0].add(torch_launcher.READY_KEY, 0) == 1  # it said it reached the store


def test_rank_0_done_first_keeps_its_store_until_a_late_rank_has_reached_it(tmp_path):
    """A training function that never calls init_process_group (``runtime:size``): rank 0 ends before
    rank 1 has even looked for the store. Rank 0's process keeps it until rank 1 has reached it."""
    import os
    import subprocess
    import sys

    hold = torch_launcher.PortHold("127.0.0.1")
    port = hold.port
    code = "from airflow_provider_horovod.runner.launchers import torch as t; t.before_main(); print('done', flush=True)"

    def rank(n: int) -> subprocess.Popen:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(n), WORLD_SIZE="2")
        env.update({torch_launcher.STORE_FD_ENV: str(hold._sock.fileno())} if n == 0 else {})
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True,
                                pass_fds=(hold._sock.fileno(),) if n == 0 else ())

    rank0 = rank(0)
    assert rank0.stdout.readline() == "done\n"  # its function is over; the interpreter is at its exit
    time.sleep(1.0)
    assert rank0.poll() is None  # still holding the store for rank 1
    rank1 = rank(1)
    try:
        assert rank1.wait(timeout=60) == 0 and rank0.wait(timeout=10) == 0
    finally:
        hold.close()
        for proc in (rank0, rank1):
            if proc.poll() is None:
                proc.kill()


def test_a_store_that_never_comes_up_is_named_with_its_address(monkeypatch):
    port = _free_port()
    _rank_env(monkeypatch, 1, port)
    monkeypatch.setattr(torch_launcher, "STORE_WAIT_S", 0.3)
    with pytest.raises(RuntimeError, match="Rank 0's torch.distributed store at 127.0.0.1:%d did not come up" % port):
        torch_launcher.before_main()


@pytest.fixture
def hold():
    held = torch_launcher.PortHold("127.0.0.1")
    yield held
    held.close()


def _rank_0_env(monkeypatch, hold) -> None:
    _rank_env(monkeypatch, 0, hold.port)
    # a copy, as rank 0's process inherits one: torch's store closes the descriptor it serves on
    monkeypatch.setenv(torch_launcher.STORE_FD_ENV, str(os.dup(hold._sock.fileno())))
    monkeypatch.setenv(torch_launcher.AGENT_STORE_ENV, "True")  # as the runner starts it


def test_rank_0_starts_the_store_that_the_ranks_then_join(monkeypatch, hold):
    import atexit

    import torch.distributed as dist

    port = hold.port
    _rank_0_env(monkeypatch, hold)
    monkeypatch.setattr(torch_launcher, "_store", None)
    torch_launcher.before_main()
    assert os.environ[torch_launcher.AGENT_STORE_ENV] == "True"  # back for init_process_group, a client
    # rank 0's exit now waits (READY_WAIT_S) for rank 1 to say it reached the store; in this process, that
    # wait would come at pytest's exit (it once cost the suite a minute)
    atexit.unregister(torch_launcher._wait_for_ranks)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # what init_process_group does with the agent store
    client.set("hello", "rank 1")
    assert torch_launcher._store.get("hello") == b"rank 1"
    client.add(torch_launcher.READY_KEY, 1)  # what rank 1's before_main says
    started = time.monotonic()
    torch_launcher._wait_for_ranks(torch_launcher._store, 1)
    assert time.monotonic() - started < 1.0


def test_a_rank_that_connects_before_rank_0_serves_waits_in_the_held_sockets_backlog(monkeypatch, hold):
    """The task listens from its start: rank 1's connection is queued until rank 0's store takes the socket."""
    import atexit

    _rank_env(monkeypatch, 1, hold.port)
    joined = threading.Thread(target=torch_launcher.before_main, daemon=True)
    joined.start()
    time.sleep(1.0)
    assert joined.is_alive()  # connected, answered by no one yet
    _rank_0_env(monkeypatch, hold)
    monkeypatch.setattr(torch_launcher, "_store", None)
    torch_launcher.before_main()
    atexit.unregister(torch_launcher._wait_for_ranks)
    joined.join(timeout=30)
    assert not joined.is_alive() and torch_launcher._store.add(torch_launcher.READY_KEY, 0) == 1


def test_rank_0_refuses_a_socket_that_does_not_listen_on_master_port(monkeypatch):
    """Never a bind of its own, and never, with ``TORCHELASTIC_USE_AGENT_STORE``, a client instead."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        _rank_env(monkeypatch, 0, bound.getsockname()[1])
        monkeypatch.setenv(torch_launcher.STORE_FD_ENV, str(bound.fileno()))
        monkeypatch.setenv(torch_launcher.AGENT_STORE_ENV, "True")
        with pytest.raises(TorchStoreError, match=r"descriptor \d+ is not listening on port %d" % bound.getsockname()[1]):
            torch_launcher.before_main()


@pytest.mark.parametrize("fd", [None, "not-a-number", "9999"])
def test_rank_0_without_the_tasks_socket_names_the_fix(monkeypatch, fd):
    port = _free_port()
    _rank_env(monkeypatch, 0, port)
    if fd is None:
        monkeypatch.delenv(torch_launcher.STORE_FD_ENV, raising=False)
    else:
        monkeypatch.setenv(torch_launcher.STORE_FD_ENV, fd)
    with pytest.raises(TorchStoreError, match=r"127.0.0.1:%d .*Start the rank with the runner" % port):
        torch_launcher.before_main()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # rank 0 never bound the port itself


def test_the_held_port_listens_on_the_plans_address_only():
    hold = torch_launcher.PortHold("127.0.0.1")
    try:
        assert hold._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert hold._sock.getsockname() == ("127.0.0.1", hold.port)
        assert hold.pass_fds(_slot(0)) == (hold._sock.fileno(),) and hold.pass_fds(_slot(1)) == ()
        assert hold.store_env(_slot(1)) == {}
    finally:
        hold.close()
    assert torch_launcher.PortHold(None).ports() == {}  # partitions but 0 hold nothing


def _slot(rank: int):
    import types

    return types.SimpleNamespace(rank=rank)


def test_a_held_port_whose_rank_0_never_serves_is_named_with_its_address(monkeypatch, hold):
    """The task listens from its start, so the connection succeeds; the store's answer never comes."""
    _rank_env(monkeypatch, 1, hold.port)
    monkeypatch.setattr(torch_launcher, "STORE_WAIT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(TorchStoreError, match="store at 127.0.0.1:%d did not come up within 1 s" % hold.port):
        torch_launcher.before_main()
    assert time.monotonic() - started < 30
