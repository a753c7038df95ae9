"""Torch's store under ``launcher="torch"`` (``launchers/torch.py`` ``before_main``): rank 0 starts it
before the training function; the other ranks wait until it listens, and say so when it never does."""

from __future__ import annotations

import socket
import threading
import time

import pytest

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
    port = _free_port()
    _rank_env(monkeypatch, 1, port)
    listener = socket.socket()

    def listen_later() -> None:
        time.sleep(0.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    started = time.monotonic()
    torch_launcher.before_main()
    waited = time.monotonic() - started
    listener.close()
    assert 0.4 < waited < 5.0


def test_a_store_that_never_comes_up_is_named_with_its_address(monkeypatch):
    port = _free_port()
    _rank_env(monkeypatch, 1, port)
    monkeypatch.setattr(torch_launcher, "STORE_WAIT_S", 0.3)
    with pytest.raises(RuntimeError, match="Rank 0's torch.distributed store at 127.0.0.1:%d did not come up" % port):
        torch_launcher.before_main()


def test_rank_0_starts_the_store_that_the_ranks_then_join(monkeypatch):
    import torch.distributed as dist

    port = _free_port()
    _rank_env(monkeypatch, 0, port)
    torch_launcher.before_main()
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # what init_process_group does with the agent store
    client.set("hello", "rank 1")
    assert torch_launcher._store.get("hello") == b"rank 1"
