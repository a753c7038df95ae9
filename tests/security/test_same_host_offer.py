"""Finding N2 of issue #21, the same-host hand-over: the driver copies artifacts only from the
plan's rank 0 task folder (named as this run's partition 0 makes it), opened by descriptor from the
folder where it read the proof, so a folder swapped in after that is never copied; ``fetch-resume``
(which hands out a proof file of the driver's) is served only after the plan, once per host leader."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_horovod.runner import transfer, names, wire
from airflow_provider_horovod.runner.transfer import take_tree
from airflow_provider_horovod.runner.driver.channel import Channel
from tests.plans import loopback_plan
from tests.security.attacker import SECRET, TASK, hung_up
from tests.security.test_artifact_transfer import RUN_ID, _put, _staged, _task_dir


def _plan(task_dirs: list[Path]):
    """A plan with one task per folder, each on a host of its own (so each is its host's leader)."""
    return loopback_plan(task_dirs)


@pytest.fixture
def channel(tmp_path):
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / "epoch-3.pt").write_bytes(b"resume weights")
    channel = Channel(SECRET, run_id=RUN_ID, artifact_staging=tmp_path / "staging", resume_root=tmp_path / "resume")
    channel.start("127.0.0.1")
    yield channel
    channel.close()


def _fetch_resume(channel: Channel, partition: int, dest: Path) -> bool:
    """Ask for resume_from as a task would; whether the driver served it."""
    conn = wire.connect(channel.address, TASK)
    try:
        conn.send({"t": "fetch-resume", "partition": partition})
        conn.sock.settimeout(5)
        try:
            _mode, files = take_tree(conn, dest)
        except (ConnectionError, OSError, ValueError):
            return False
        conn.send({"ok": True, "files": len(files)})
        return True
    finally:
        conn.close()


def test_fetch_resume_before_the_plan_hands_out_no_proof_file(tmp_path, channel):
    conn = wire.connect(channel.address, TASK)
    conn.send({"t": "fetch-resume", "partition": 0})
    assert hung_up(conn.sock)  # no offer: no path and token of a file of the driver's user
    conn.close()
    assert channel._proofs is None or not list(channel._proofs.iterdir())


def test_fetch_resume_is_served_once_to_each_host_leader_and_to_no_one_else(tmp_path, channel):
    leaders = [_task_dir(tmp_path / "a"), _task_dir(tmp_path / "b")]
    channel.expect_plan(_plan(leaders))
    assert _fetch_resume(channel, 0, tmp_path / "got-0")
    assert (tmp_path / "got-0" / "epoch-3.pt").read_bytes() == b"resume weights"
    assert not _fetch_resume(channel, 0, tmp_path / "again")  # a second time: refused
    assert not _fetch_resume(channel, 7, tmp_path / "stranger")  # not a task of the plan
    assert _fetch_resume(channel, 1, tmp_path / "got-1")


def test_an_offer_before_the_plan_is_streamed_never_copied(tmp_path, channel):
    task = _task_dir(tmp_path)
    assert _put(channel, transfer.make_offer(task / names.ARTIFACTS_DIR, task), stream_root=None)["ok"]
    assert channel.transport == "stream" and _staged(tmp_path) == {}


def test_a_plan_naming_a_folder_this_run_did_not_make_is_never_copied_from(tmp_path, channel):
    """Rank 0's task folder comes from its own facts: one that names another private folder of the
    driver's user (another run's, say) is not one the driver copies from."""
    other = tmp_path / "another-runs-folder"
    (other / names.ARTIFACTS_DIR).mkdir(parents=True)
    other.chmod(0o700)
    (other / names.ARTIFACTS_DIR / "their-model.pt").write_bytes(b"another run's checkpoint")
    channel.expect_plan(_plan([other]))
    assert _put(channel, transfer.make_offer(other / names.ARTIFACTS_DIR, other), stream_root=None)["ok"]
    assert channel.transport == "stream" and _staged(tmp_path) == {}


def test_a_task_folder_swapped_for_a_link_after_the_proof_was_read_is_never_copied(tmp_path, channel, monkeypatch):
    """The race of N2, won at the exact point: once the driver has read the proof in rank 0's
    task folder, the folder's path becomes a link to another private folder of the driver's user."""
    task = _task_dir(tmp_path / "here")
    other = tmp_path / "another-run"
    (other / names.ARTIFACTS_DIR).mkdir(parents=True)
    other.chmod(0o700)
    (other / names.ARTIFACTS_DIR / "their-model.pt").write_bytes(b"another run's checkpoint")
    channel.expect_plan(_plan([task]))
    read = transfer._read_proof

    def read_then_swap(dir_fd, name, token):
        found = read(dir_fd, name, token)
        task.parent.rename(tmp_path / "moved-away")
        (tmp_path / "here").mkdir()
        (tmp_path / "here" / task.name).symlink_to(other)
        return found

    monkeypatch.setattr(transfer, "_read_proof", read_then_swap)
    assert _put(channel, transfer.make_offer(task / names.ARTIFACTS_DIR, task), stream_root=None)["ok"]
    assert "their-model.pt" not in str(_staged(tmp_path))
    assert _staged(tmp_path) == {"checkpoints/epoch-1.pt": b"weights"}  # the folder the proof was read in
