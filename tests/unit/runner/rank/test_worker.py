"""The rank process's own decisions (``rank/worker.py``): which rank it is, its key, its return value."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_horovod.exceptions import PayloadError
from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.rank import worker


@pytest.mark.parametrize(("env", "rank"), [
    ({names.ENV_RANK: "3", "OMPI_COMM_WORLD_RANK": "1"}, 3),  # Gloo and torch: the task said which
    ({"OMPI_COMM_WORLD_RANK": "1"}, 1),  # mpirun: MPI says
    ({"PMIX_RANK": "2"}, 2),
])
def test_a_rank_knows_its_rank_from_its_launcher(monkeypatch, env, rank):
    for name in (names.ENV_RANK, "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert worker._rank() == rank


def test_a_rank_started_without_a_rank_says_so(monkeypatch):
    for name in (names.ENV_RANK, "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="without HVDRUNNER_RANK"):
        worker._rank()


def test_the_key_file_is_read_once_and_removed(tmp_path):
    key = tmp_path / "rank-0.key"
    key.write_text(b"\x01\x02".hex())
    assert worker._take_key(key) == b"\x01\x02" and not key.exists()
    assert worker._take_key(key) == b""  # gone: a second reader gets nothing


def test_a_return_value_that_cannot_travel_says_what_to_return_instead():
    with pytest.raises(PayloadError, match="Rank 0's return value \\(a lock\\) cannot be pickled") as info:
        worker._pickled_result(threading.Lock())
    assert "runtime.checkpoint_dir()" in str(info.value)


def test_a_ranks_last_lines_go_out_when_it_ends_not_a_read_interval_later(tmp_path, monkeypatch):
    """The follower waits for new lines between reads; the rank's end (``close``) wakes it, so the
    last lines are sent at once (the interval is made far longer than close's bounded wait here)."""
    import time

    monkeypatch.setattr(worker, "FOLLOW_INTERVAL_S", 60.0)
    sent = []

    class Client:
        def send(self, message) -> None:
            sent.append(message)

    log = tmp_path / "rank-0.log"
    log.write_bytes(b"")
    pump = worker.OutputPump(0, Client(), stream=True, log_path=log, forward=False)
    time.sleep(0.3)  # the follower found nothing and waits
    with log.open("ab") as f:
        f.write(b"the last line\n")
    began = time.monotonic()
    pump.close()
    assert time.monotonic() - began < 0.9  # close's own bound is 1 s: the follower ended, not the wait
    assert not pump._reader.is_alive()
    assert [line for batch in sent for line in batch.lines] == ["the last line"]
    assert list(pump.tail) == ["the last line"]
