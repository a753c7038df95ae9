"""Rank 0's artifacts reach the driver, and nothing else does. Findings 1 and 7 of issue #10: a
forged or replayed offer, links in the checkpoint folder, and every malformed stream entry."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner import names, wire
from airflow_provider_horovod.runner.transfer import Limits, make_offer, send_tree
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import UploadFinished, UploadStarted
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan
from tests.security.attacker import SECRET, TASK

RUN_ID = "0123456789ab"


def _task_dir(tmp_path: Path, run_id: str = RUN_ID) -> Path:
    """A folder named and made as rank 0's barrier task makes its own (0700)."""
    task = tmp_path / ((names.TASK_DIR_PREFIX % (run_id, "p0", os.getpid())) + "x1")
    (task / names.ARTIFACTS_DIR / "checkpoints").mkdir(parents=True)
    task.chmod(0o700)
    (task / names.ARTIFACTS_DIR / "checkpoints" / "epoch-1.pt").write_bytes(b"weights")
    return task


def _expect(channel: Channel, task: Path) -> None:
    """The driver sent a plan whose rank 0 runs in ``task`` (one host, partition 0 its leader)."""
    facts = TaskFacts(partition=0, executor="e", address="127.0.0.1", pid=os.getpid(), task_dir=str(task), python="3.11")
    channel.expect_plan(make_plan([facts]))


@pytest.fixture
def channel(tmp_path):
    events = []
    channel = Channel(SECRET, run_id=RUN_ID, artifact_staging=tmp_path / "staging", on_event=events.append,
                      limits=Limits(max_bytes=1 << 20, max_files=3))
    channel.start("127.0.0.1")
    channel.events = events
    yield channel
    channel.close()


def _put(channel: Channel, offer, stream_root: Path | None = None, frames=None) -> dict:
    """Hand over files as a (possibly hostile) task would; return the driver's receipt."""
    conn = wire.connect(channel.address, TASK)
    try:
        conn.send({"t": "put"})
        conn.send({"offer": offer})
        if conn.recv()["mode"] == "stream":
            if frames is None:
                send_tree(conn, stream_root)
            else:
                try:
                    for frame in frames:
                        conn.send_bytes(frame) if isinstance(frame, bytes) else conn.send(frame)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the driver hung up on a bad frame before the rest arrived
        conn.sock.settimeout(10)
        try:
            return conn.recv()
        except ConnectionError:
            return {"ok": False, "hung_up": True}
    finally:
        conn.close()


def _staged(tmp_path: Path) -> dict[str, bytes]:
    root = tmp_path / "staging"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_genuine_offer_from_rank_0s_task_folder_is_copied(tmp_path, channel):
    task = _task_dir(tmp_path)
    _expect(channel, task)
    receipt = _put(channel, make_offer(task / names.ARTIFACTS_DIR, task))
    assert receipt["ok"] and channel.transport == "copy"
    assert _staged(tmp_path) == {"checkpoints/epoch-1.pt": b"weights"}
    assert not list(task.glob("offer-*"))  # the proof is used once


def test_an_offer_proved_by_a_public_file_copies_nothing(tmp_path, channel):
    # The review's attack: any file whose whole content is the "token" served as proof.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "id_rsa").write_text("PRIVATE KEY")
    public = tmp_path / ("offer-" + "0" * 16)
    public.write_text("x" * 64)
    public.chmod(0o644)
    offer = {"root": str(private), "proof": str(public), "token": "x" * 64}
    assert _put(channel, offer, stream_root=None)["ok"]
    assert channel.transport == "stream" and _staged(tmp_path) == {}


@pytest.mark.parametrize("forgery", ["another run", "not the artifacts folder", "proof elsewhere", "shared folder",
                                     "proof is a link"])
def test_a_forged_or_replayed_offer_falls_back_to_the_stream(tmp_path, channel, forgery):
    task = _task_dir(tmp_path, run_id="ba9876543210" if forgery == "another run" else RUN_ID)
    (task / "secret.txt").write_text("not an artifact")
    _expect(channel, task)
    root = task if forgery == "not the artifacts folder" else task / names.ARTIFACTS_DIR
    offer = make_offer(root, tmp_path if forgery == "proof elsewhere" else task)
    if forgery == "shared folder":
        task.chmod(0o755)
    if forgery == "proof is a link":
        real = Path(offer["proof"])
        moved = tmp_path / "elsewhere-proof"
        real.rename(moved)
        real.symlink_to(moved)
    assert _put(channel, offer, stream_root=None)["ok"]
    assert channel.transport == "stream" and _staged(tmp_path) == {}


@pytest.mark.parametrize("transport", ["copy", "stream"])
def test_links_in_rank_0s_folder_are_never_followed(tmp_path, channel, transport):
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "passwords.txt").write_text("secret")
    (outside / "dir" / "more.txt").write_text("secret too")
    task = _task_dir(tmp_path)
    artifacts = task / names.ARTIFACTS_DIR
    (artifacts / "checkpoints" / "link.pt").symlink_to(outside / "passwords.txt")
    (artifacts / "linked-dir").symlink_to(outside / "dir")
    os.mkfifo(artifacts / "pipe")  # would block a reader that opens it
    _expect(channel, task)
    offer = make_offer(artifacts, task) if transport == "copy" else None
    assert _put(channel, offer, stream_root=artifacts)["ok"]
    assert channel.transport == transport
    assert _staged(tmp_path) == {"checkpoints/epoch-1.pt": b"weights"}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_files_of_another_user_are_not_copied(tmp_path, channel):
    task = _task_dir(tmp_path)
    theirs = task / names.ARTIFACTS_DIR / "theirs.bin"
    theirs.write_bytes(b"someone else's")
    os.chown(theirs, 65534, 65534)
    _expect(channel, task)
    assert _put(channel, make_offer(task / names.ARTIFACTS_DIR, task))["ok"]
    assert channel.transport == "copy" and _staged(tmp_path) == {"checkpoints/epoch-1.pt": b"weights"}


@pytest.mark.parametrize(
    "frames, says",
    [
        ([{"file": "", "size": 1}, b"x"], "empty"),
        ([{"file": "../escape.pt", "size": 1}, b"x"], "outside"),
        ([{"file": "/etc/escape.pt", "size": 1}, b"x"], "outside"),
        ([{"file": "a/./b.pt", "size": 1}, b"x"], "outside"),
        ([{"file": "nul\0.pt", "size": 1}, b"x"], "not plain text"),
        ([{"file": 7, "size": 1}, b"x"], "not plain text"),
        ([{"file": "a.pt", "size": 1}, b"x" * (1 << 16)], "larger than the 1 bytes"),
        ([{"file": "a.pt", "size": -5}], "not a byte count"),
        ([{"file": "a.pt", "size": True}, b"x"], "not a byte count"),
        ([{"file": "a.pt", "size": 2 << 20}], "max_artifact_bytes"),
        ([{"file": "%d.pt" % i, "size": 0} for i in range(4)], "max_artifact_files"),
        ([[1, 2]], "not a JSON object"),
    ],
)
def test_a_malformed_stream_fails_the_upload_and_writes_nothing_outside_staging(tmp_path, channel, frames, says):
    before = sorted(p.name for p in tmp_path.iterdir())
    frames = [f if not isinstance(f, list) else b"[1, 2]" for f in frames]
    receipt = _put(channel, None, frames=[*frames, {"end": True}])
    assert not receipt["ok"]
    assert says in str(channel.upload_error)
    assert channel.events == [UploadStarted(), UploadFinished(error=str(channel.upload_error))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*before, "staging"})
    assert not Path("/etc/escape.pt").exists()


def test_a_chunk_not_signed_with_the_key_fails_the_upload_and_leaves_no_file(tmp_path, channel):
    # A peer on the path rewrites the second chunk of a file in flight: the chunk's tag no longer
    # matches, so the upload fails and neither the file nor its partial first chunk stays.
    body = b"w" * (1 << 16)
    conn = wire.connect(channel.address, TASK)
    try:
        conn.send({"t": "put"})
        conn.send({"offer": None})
        assert conn.recv()["mode"] == "stream"
        conn.send({"file": "checkpoints/epoch-1.pt", "size": 2 * len(body)})
        conn.send_bytes(body)
        conn.sock.sendall(wire._HEADER.pack(len(body)) + bytes(wire.TAG_BYTES) + b"x" * len(body))
        conn.sock.settimeout(10)
        receipt = conn.recv()
    finally:
        conn.close()
    assert not receipt["ok"] and "failed verification" in receipt["error"]
    assert "a chunk of checkpoints/epoch-1.pt failed verification" in str(channel.upload_error)
    assert _staged(tmp_path) == {}


def test_the_channel_keeps_serving_after_a_malformed_upload(tmp_path, channel):
    assert not _put(channel, None, frames=[{"file": "../x", "size": 0}])["ok"]
    task = _task_dir(tmp_path)
    conn = wire.connect(channel.address, TASK)
    conn.send({"t": "hello", "partition": 0, "executor": "e"})
    conn.close()
    channel.upload_error = None
    assert _put(channel, None, stream_root=task / names.ARTIFACTS_DIR)["ok"]
    assert _staged(tmp_path)["checkpoints/epoch-1.pt"] == b"weights"


def test_a_run_past_the_artifact_limit_fails_with_an_error_naming_it(tmp_path):
    from airflow_provider_horovod import HorovodRunner

    def train():
        from airflow_provider_horovod import runtime

        for i in range(3):
            (Path(runtime.checkpoint_dir()) / ("epoch-%d.pt" % i)).write_bytes(b"w")
        return "trained"

    runner = HorovodRunner(-1, launcher="gloo", artifact_dir=tmp_path / "out", max_artifact_files=2)
    with pytest.raises(ArtifactError, match="max_artifact_files") as raised:
        runner.run(train)
    assert raised.value.result == "trained"
    assert runner.last_run.artifacts["complete"] is False


def test_bad_limits_are_refused_before_anything_starts():
    from airflow_provider_horovod import HorovodRunner

    with pytest.raises(ValueError, match="max_artifact_bytes must be a positive int"):
        HorovodRunner(-1, max_artifact_bytes=0)


def test_download_keeps_every_file_inside_its_folder_and_follows_no_link(tmp_path):
    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

    stored = tmp_path / "stored"
    (stored / "checkpoints").mkdir(parents=True)
    (stored / "checkpoints" / "epoch-1.pt").write_bytes(b"weights")
    (tmp_path / "secret.txt").write_text("secret")
    (stored / "checkpoints" / "link.pt").symlink_to(tmp_path / "secret.txt")
    local = Path(HorovodRunnerHook().download(str(stored)))
    try:
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        assert files == ["checkpoints/epoch-1.pt"]
    finally:
        shutil.rmtree(local)


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_a_task_on_the_drivers_host_copies_resume_from_itself(tmp_path, monkeypatch, transport):
    from airflow_provider_horovod.runner.transfer import take_tree

    monkeypatch.setenv("HVDRUNNER_ARTIFACT_TRANSPORT", transport)
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / "epoch-3.pt").write_bytes(os.urandom(1 << 16))
    (tmp_path / "resume" / "link.pt").symlink_to(tmp_path / "resume" / "epoch-3.pt")
    channel = Channel(SECRET, resume_root=tmp_path / "resume")
    channel.start("127.0.0.1")
    _expect(channel, tmp_path)
    try:
        conn = wire.connect(channel.address, TASK)
        conn.send({"t": "fetch-resume", "partition": 0})
        mode, files = take_tree(conn, tmp_path / "task" / "resume")
        conn.send({"ok": True, "files": len(files)})
        conn.close()
        assert mode == ("copy" if transport == "auto" else "stream")
        assert sorted(p.name for p in (tmp_path / "task" / "resume").iterdir()) == ["epoch-3.pt"]
        assert (tmp_path / "task" / "resume" / "epoch-3.pt").read_bytes() == (tmp_path / "resume" / "epoch-3.pt").read_bytes()
        proofs = channel._proofs
        assert (proofs is not None) == (transport == "auto")
    finally:
        channel.close()
    assert proofs is None or not proofs.exists()  # the driver's proof files go with the channel


def test_a_task_that_cannot_write_its_proof_file_still_delivers_by_stream(tmp_path, channel):
    from airflow_provider_horovod.runner.transfer import offer_tree

    task = _task_dir(tmp_path)
    conn = wire.connect(channel.address, TASK)
    conn.send({"t": "put"})
    offer_tree(conn, task / names.ARTIFACTS_DIR, tmp_path / "no-such-folder")
    conn.close()
    assert channel.transport == "stream"
    assert _staged(tmp_path) == {"checkpoints/epoch-1.pt": b"weights"}
