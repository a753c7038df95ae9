"""Rank 0's checkpoint versions reach the driver while training runs: the rename rule and
``commit_checkpoint`` make versions, only changed files travel, a fast writer is coalesced, and
rank 0's disk holds at most two versions. A real channel and a real shipper thread; no Spark."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_horovod import runtime
from airflow_provider_horovod.runner import transfer, names, wire
from airflow_provider_horovod.runner.driver import versions
from airflow_provider_horovod.runner.task import shipper
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.driver.channel import Channel


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def write_renamed(folder: Path, name: str, data: bytes) -> None:
    tmp = folder / (name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, folder / name)


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A driver (channel + version sink into ``artifacts``) and rank 0's task folder with its shipper."""

    class Run:
        def __init__(self, keep: int = 2, on_commit=None, say=None) -> None:
            self.artifacts = tmp_path / "artifacts"
            self.artifacts.mkdir()
            secret = wire.new_secret()
            self.sink = versions.VersionSink(self.artifacts, keep=keep, limits=Limits(), on_commit=on_commit)
            self.channel = Channel(secret, run_id="abc123", versions=self.sink)
            address = self.channel.start("127.0.0.1")
            self.task = names.TaskDir(tempfile.mkdtemp(prefix=names.TASK_DIR_PREFIX % ("abc123", "p0", os.getpid())))
            self.channel.expect_artifacts_from(self.task.path)
            self.shipper = shipper.Shipper(address, secret, self.task, say)
            self.folder = self.shipper.folder
            monkeypatch.setenv(names.ENV_TASK_DIR, str(self.task.path))
            monkeypatch.setenv(names.ENV_RANK, "0")
            self.shipper.start()

        def committed(self) -> list[versions.Version]:
            return [v for v, _ in versions.committed(self.artifacts)]

        def close(self) -> None:
            self.shipper.stop()
            self.channel.close()

    made: list[Run] = []

    def make(**kwargs) -> Run:
        made.append(Run(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_renamed_checkpoint_is_a_version_and_only_changed_files_travel_again(run):
    r = run()
    write_renamed(r.folder, "model.pt", b"m" * 1000)
    write_renamed(r.folder, "optimizer.pt", b"o" * 500)
    wait_for(lambda: r.committed() and dict(r.committed()[-1].files) == {"model.pt": 1000, "optimizer.pt": 500})
    before = r.committed()[-1].seq
    (r.folder / "half.pt.tmp").write_bytes(b"never offered")
    write_renamed(r.folder, "model.pt", b"M" * 1200)
    wait_for(lambda: r.committed()[-1].seq > before and dict(r.committed()[-1].files)["model.pt"] == 1200)
    newest, path = versions.committed(r.artifacts)[-1]
    assert newest.sent == ("model.pt",)  # the optimizer did not change: it stayed on rank 0's host
    assert (path / "model.pt").read_bytes() == b"M" * 1200 and (path / "optimizer.pt").read_bytes() == b"o" * 500
    assert not (path / "half.pt.tmp").exists()
    assert len(r.committed()) <= 2  # keep_checkpoints=2


def test_commit_checkpoint_makes_the_only_versions_once_called_with_step_and_metrics(run):
    r = run()
    (r.folder / "weights.bin").write_bytes(b"w1")
    (r.folder / "meta.json").write_text("{}")
    runtime.commit_checkpoint(step=7, loss=0.5)
    wait_for(lambda: any(v.step == 7 for v in r.committed()))
    version = next(v for v in r.committed() if v.step == 7)
    assert version.metrics == {"loss": 0.5} and dict(version.files) == {"meta.json": 2, "weights.bin": 2}
    assert version.size == 4 and version.time > 0
    count = len(versions.committed(r.artifacts))
    write_renamed(r.folder, "weights.bin", b"w2-half-of-a-pair")  # no commit call: no version
    time.sleep(1.0)
    assert len(versions.committed(r.artifacts)) == count


def test_a_save_no_commit_checkpoint_takes_in_a_run_that_calls_it_is_named_in_a_warning_within_the_grace(
        run, monkeypatch):
    """The run commits once at the start, then saves the rename rule's way: on main's code no version
    holds those saves and nothing says so (a restart resumes from the start's version)."""
    monkeypatch.setattr(shipper, "UNCOMMITTED_WARN_S", 1.0)
    said: list[str] = []
    r = run(say=said.append)
    write_renamed(r.folder, "step.txt", b"0")  # before the call, the rename may make a version of its own
    runtime.commit_checkpoint(step=0)
    wait_for(lambda: [v.step for v in r.committed()][-1:] == [0])
    time.sleep(1.5)
    assert said == []  # every save so far is in a version
    write_renamed(r.folder, "step.txt", b"1")  # the how-to's way, with no call after it
    started = time.monotonic()
    wait_for(lambda: said, timeout=10)
    assert 0.8 <= time.monotonic() - started < 5.0  # the grace, then the next poll
    (text,) = said
    assert text.startswith("WARNING: rank 0 saved step.txt in runtime.checkpoint_dir() 1 s ago and has not called "
                           "runtime.commit_checkpoint() since. This run calls commit_checkpoint(), so only its calls "
                           "make checkpoint versions and no version holds this save: a restart or a retry resumes "
                           "from the version committed at step 0. Call runtime.commit_checkpoint() after each save")
    assert [v.step for v in r.committed()][-1:] == [0]


def test_a_save_committed_within_the_grace_is_no_warning_and_one_left_at_the_attempts_end_is(run, monkeypatch):
    monkeypatch.setattr(shipper, "UNCOMMITTED_WARN_S", 1.0)
    said: list[str] = []
    r = run(say=said.append)
    for step in range(3):
        write_renamed(r.folder, "step.txt", str(step).encode())
        time.sleep(0.5)  # a save that takes a while: the call comes after it
        runtime.commit_checkpoint(step=step)
    wait_for(lambda: [v.step for v in r.committed()][-1:] == [2])
    time.sleep(1.5)
    assert said == []
    write_renamed(r.folder, "final.pt", b"model")
    r.shipper.stop()  # the attempt ends before the grace is over
    (text,) = said
    assert "saved final.pt in runtime.checkpoint_dir() and the attempt ends without a runtime.commit_checkpoint() " \
           "call after it" in text and "a restart resumes from the version committed at step 2" in text


def test_a_run_that_never_calls_commit_checkpoint_is_never_warned_about_its_saves(run, monkeypatch):
    monkeypatch.setattr(shipper, "UNCOMMITTED_WARN_S", 0.2)
    said: list[str] = []
    r = run(say=said.append)
    write_renamed(r.folder, "model.pt", b"m")
    wait_for(lambda: r.committed())
    (r.folder / "optimizer.pt").write_bytes(b"written under its final name and closed: a version too")
    time.sleep(0.6)
    r.shipper.stop()
    assert said == []


def test_a_writer_faster_than_the_link_is_coalesced_and_rank_0_holds_at_most_two_versions(run):
    slow = threading.Event()

    def slow_store(version, path):
        time.sleep(0.5)  # the store behind the driver is slow: versions queue up on rank 0's side
        slow.set()

    r = run(on_commit=slow_store)
    size = 256 << 10
    peak = [0]

    def rank_side_bytes() -> int:
        """Bytes rank 0's task folder holds on disk, each inode once (hard links are free). The shipper
        removes an offer once it is sent, maybe between the walk's listing and the lstat: a file gone
        by then holds nothing."""
        seen, total = set(), 0
        for dirpath, _dirs, files in os.walk(r.task.path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        return total

    for step in range(40):
        write_renamed(r.folder, "model.pt", bytes([step]) * size)
        peak[0] = max(peak[0], rank_side_bytes())
        time.sleep(0.02)
    wait_for(lambda: r.committed() and r.committed()[-1].files == (("model.pt", size),)
             and (versions.committed(r.artifacts)[-1][1] / "model.pt").read_bytes()[:1] == bytes([39]))
    assert slow.is_set()
    assert r.committed()[-1].seq < 40  # coalesced: not one version per write
    # the live checkpoint and at most the one in flight; the version being built also holds its
    # marker, a few bytes of JSON (a sample taken then read 2 * size + 64 in one CI run)
    assert peak[0] <= 2 * size + 4096
    assert not list((r.task.path).glob(names.COMMITS_DIR + "/*"))


def test_a_file_rewritten_in_place_while_it_travels_is_never_committed_half_new(run, monkeypatch):
    original = transfer.send_tree  # what the version exchange streams with (transfer.give_tree)

    def rewrite_then_send(conn, root):
        path = root / "model.pt"
        if path.exists() and path.read_bytes()[:1] == b"a":
            with open(r.folder / "model.pt", "r+b") as f:  # the same inode as the outbox's link
                f.write(b"b")
        return original(conn, root)

    monkeypatch.setattr(transfer, "send_tree", rewrite_then_send)
    monkeypatch.setenv(names.ENV_ARTIFACT_TRANSPORT, "stream")
    r = run()
    (r.folder / "model.pt").write_bytes(b"a" * 100)
    wait_for(lambda: r.shipper.errors)
    assert "changed while it was sent" in r.shipper.errors[0]
    # the rewrite closed the file: that state is the next version, committed whole
    wait_for(lambda: r.committed())
    assert [(p / "model.pt").read_bytes() for _, p in versions.committed(r.artifacts)] == [b"b" + b"a" * 99]


def test_commit_checkpoint_outside_a_run_does_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(names.ENV_TASK_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    runtime.commit_checkpoint(step=1)
    assert not (tmp_path / names.COMMITS_DIR).exists()


def test_commit_checkpoint_of_an_empty_folder_warns_and_makes_no_version(tmp_path, monkeypatch):
    task = names.TaskDir(tmp_path)
    monkeypatch.setenv(names.ENV_TASK_DIR, str(task.path))
    monkeypatch.setenv("HOROVOD_RANK", "0")
    with pytest.warns(UserWarning, match=r"commit_checkpoint\(step=3\): .* is empty.*write its files first"):
        runtime.commit_checkpoint(step=3)
    assert not (task.path / names.COMMITS_DIR).exists()


def test_a_commit_not_yet_taken_is_replaced_by_the_next_and_its_snapshot_goes_without_the_caller(tmp_path,
                                                                                                 monkeypatch):
    """No shipper takes the snapshots: the second call's replaces the first's, whose files (the last
    link of a model since replaced) a thread removes, not the call."""
    task = names.TaskDir(tmp_path)
    monkeypatch.setenv(names.ENV_TASK_DIR, str(task.path))
    monkeypatch.setenv("HOROVOD_RANK", "0")
    folder = runtime.checkpoint_dir()
    write_renamed(folder, "model.pt", b"one" * 1000)
    runtime.commit_checkpoint(step=1)
    write_renamed(folder, "model.pt", b"two")  # the first snapshot now holds the only link of "one"
    runtime.commit_checkpoint(step=2)
    commits = task.path / names.COMMITS_DIR
    pending = [p for p in commits.iterdir() if p.name.isdigit()]
    assert len(pending) == 1 and (pending[0] / "model.pt").read_bytes() == b"two"
    assert '"step": 2' in (pending[0] / "_COMMIT.json").read_text()
    wait_for(lambda: sorted(p.name for p in commits.iterdir()) == [pending[0].name])  # the stale one is gone


def test_the_task_end_stops_the_shipper_at_once_not_a_poll_interval_later(run, monkeypatch):
    """``stop`` wakes the shipper's wait for the folder, so a task's end is not held up by it (the
    interval is made far longer than stop's bounded join here: an unwoken shipper would be left running)."""
    monkeypatch.setattr(shipper, "POLL_S", 60.0)
    r = run()
    time.sleep(0.3)  # the shipper waits on its folder
    began = time.monotonic()
    r.shipper.stop()
    assert not r.shipper.is_alive()
    assert time.monotonic() - began < shipper.STOP_WAIT_S
