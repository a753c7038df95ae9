from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from airflow_provider_horovod.runner import transfer, wire
from airflow_provider_horovod.runner.driver.artifact_dir import commit
from airflow_provider_horovod.runner.timeline import load_timeline, summarize
from airflow_provider_horovod.runner.transfer import (
    copy_tree,
    in_progress,
    make_offer,
    open_dir,
    open_offer,
    receive_tree,
)
from airflow_provider_horovod.runner.records import Layout
from airflow_provider_horovod.runner.messages import TransferError
from airflow_provider_horovod.runner.timeline import parse

HOROVOD_STYLE = (
    '[\n{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad.0"}},\n'
    '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 100, "pid": 1},\n'
    '{"ph": "E", "ts": 150, "pid": 1},\n'
    '{"ph": "B", "name": "ALLREDUCE", "ts": 150, "pid": 1},\n'
    '{"ph": "E", "ts": 350, "pid": 1},\n'
)


def test_unterminated_timeline_is_closed(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(HOROVOD_STYLE)  # what Horovod leaves when the process dies
    assert len(load_timeline(path)) == 5


def test_timeline_cut_mid_event_keeps_every_whole_event(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(HOROVOD_STYLE + '{"ph": "B", "name": "ALLRED')
    events = load_timeline(path)
    assert len(events) == 5 and events[-1] == {"ph": "E", "ts": 350, "pid": 1}


def test_summary_counts_time_per_operation_and_share_of_wall_and_no_rank_marker_is_an_operation():
    ready = '{"ph": "X", "name": "0", "ts": 110, "dur": 0, "pid": 1},\n{"ph": "X", "name": "1", "ts": 140, "dur": 0, "pid": 1},\n'
    events = json.loads((HOROVOD_STYLE[:HOROVOD_STYLE.index('{"ph": "E", "ts": 150')] + ready
                         + HOROVOD_STYLE[HOROVOD_STYLE.index('{"ph": "E", "ts": 150'):]).rstrip().rstrip(",") + "]")
    summary = summarize(parse(events))
    assert summary["wall_ms"] == 0.25
    assert summary["operations"]["ALLREDUCE"] == {"count": 1, "total_ms": 0.2, "share_of_wall": 0.8}
    assert summary["operations"]["NEGOTIATE_ALLREDUCE"]["count"] == 1
    assert summary["operations"]["waiting for ranks"] == {"count": 1, "total_ms": 0.03, "share_of_wall": 0.12}
    assert set(summary["operations"]) == {"ALLREDUCE", "NEGOTIATE_ALLREDUCE", "waiting for ranks"}  # no "0", no "1"


def test_commit_repairs_the_timeline_and_writes_the_marker_last(tmp_path):
    staging = tmp_path / "out" / ".incoming-x"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints" / "epoch-0.pt").write_bytes(b"w")
    (staging / "timeline.json").write_text(HOROVOD_STYLE)
    info = commit(tmp_path / "out", staging, status="failed", complete=True, run_id="x", received=[])
    assert info.checkpoint == "checkpoints" and info.timeline["timeline"] == "timeline.json"
    assert len(json.loads((tmp_path / "out" / "timeline.json").read_text())) == 5
    svg = (tmp_path / "out" / "timeline.svg").read_text()
    assert svg.startswith("<svg") and "grad.0" in svg and "ALLREDUCE" in svg  # the lanes-over-time picture
    assert not staging.exists()
    assert Layout(tmp_path / "out").read_run_marker().status == "failed"


def test_incomplete_transfer_stays_in_staging(tmp_path):
    staging = tmp_path / "out" / ".incoming-y"
    (staging / "checkpoints").mkdir(parents=True)
    commit(tmp_path / "out", staging, status="cancelled", complete=False, run_id="y", received=[])
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert Layout(tmp_path / "out").read_run_marker().complete is False


def test_files_being_written_are_recognised():
    assert in_progress("epoch-3.pt.tmp") and in_progress(".epoch-3.pt") and not in_progress("epoch-3.pt")


# -- same-host copy -------------------------------------------------------------------------------
def test_offer_is_accepted_only_where_its_token_is_read_back(tmp_path):
    root = tmp_path / "artifacts"
    root.mkdir()
    offer = make_offer(root, tmp_path)
    fd = open_offer(offer)
    assert os.path.samestat(os.fstat(fd), root.stat())  # a descriptor of the folder offered
    os.close(fd)
    assert Path(offer["proof"]).stat().st_mode & 0o777 == 0o600  # only this user can prove it
    assert open_offer({**offer, "token": "0" * 64}) is None  # someone who does not know the token
    assert open_offer({**offer, "proof": str(tmp_path / "elsewhere")}) is None  # another host
    assert open_offer({**offer, "root": "artifacts"}) is None  # only absolute paths
    assert open_offer({**offer, "token": ""}) is None
    assert open_offer(None) is None


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_copy_tree_copies_finished_files_only(tmp_path):
    src = tmp_path / "src"
    (src / "checkpoints").mkdir(parents=True)
    (src / "checkpoints" / "epoch-1.pt").write_bytes(os.urandom(3 << 20))
    (src / "checkpoints" / "epoch-2.pt.tmp").write_bytes(b"half")
    (src / "timeline.json").write_text("[]")
    received = copy_tree(open_dir(src), tmp_path / "dest")
    assert _tree(tmp_path / "dest") == {k: v for k, v in _tree(src).items() if not k.endswith(".tmp")}
    assert sorted((r["path"], r["size"]) for r in received) == [("checkpoints/epoch-1.pt", 3 << 20), ("timeline.json", 2)]


@pytest.mark.parametrize("refused", [errno.EXDEV, errno.ENOSYS])
def test_copy_falls_back_when_the_kernel_refuses(tmp_path, monkeypatch, refused):
    def refuse(*_args):
        raise OSError(refused, os.strerror(refused))

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    monkeypatch.setattr(os, "sendfile", refuse, raising=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.bin").write_bytes(os.urandom(5 << 20))
    copy_tree(open_dir(tmp_path / "src"), tmp_path / "dest")
    assert _tree(tmp_path / "dest") == _tree(tmp_path / "src")


def test_copy_stopped_midway_leaves_no_file_that_looks_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "COPY_CHUNK", 1 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.bin").write_bytes(os.urandom(4 << 20))
    progress = []
    with pytest.raises(ConnectionAbortedError):
        copy_tree(open_dir(tmp_path / "src"), tmp_path / "dest", cancelled=lambda: len(progress) >= 2, progress=progress.append)
    assert progress == [1 << 20, 2 << 20]
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["model.bin.partial"]


# -- streaming ------------------------------------------------------------------------------------
@pytest.fixture
def framed():
    """Both ends of a real authenticated connection (a socket pair, the run's framing)."""
    left, right = socket.socketpair()
    key = wire.new_secret()
    client, server = wire.ClientConnection(left, key, "task"), wire.ServerConnection(right, key, "task")
    yield client, server
    client.close()
    server.close()


def _replay(conn: wire.FramedConnection, frames: list) -> threading.Thread:
    """Send ``frames`` in a thread as the other end would: objects as messages, bytes as chunks, an
    exception as the connection cut off there."""

    def send() -> None:
        with contextlib.suppress(OSError):
            for frame in frames:
                if isinstance(frame, BaseException):
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    return
                conn.send_bytes(frame) if isinstance(frame, bytes) else conn.send(frame)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_streamed_files_appear_whole_in_order(tmp_path, framed):
    body = os.urandom(10 << 20)
    frames = [{"file": "checkpoints/a.pt", "size": len(body)}, body[: 4 << 20], body[4 << 20 : 8 << 20], body[8 << 20 :],
              {"file": "timeline.json", "size": 2}, b"[]", {"end": True, "files": 2}]
    sender = _replay(framed[0], frames)
    received = receive_tree(framed[1], tmp_path / "dest")
    sender.join()
    assert received == [{"path": "checkpoints/a.pt", "size": len(body)}, {"path": "timeline.json", "size": 2}]
    assert _tree(tmp_path / "dest") == {"checkpoints/a.pt": body, "timeline.json": b"[]"}


def test_send_tree_sends_each_file_whole_across_chunk_and_piece_boundaries(tmp_path, framed, monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 3 << 20)
    monkeypatch.setattr(wire, "PIECE", 100_000)  # neither divides the other nor the file
    (tmp_path / "src" / "checkpoints").mkdir(parents=True)
    files = {"checkpoints/model.bin": os.urandom((7 << 20) + 12345), "empty.txt": b"", "tiny.json": b"{}"}
    for rel, data in files.items():
        (tmp_path / "src" / rel).write_bytes(data)
    sender = threading.Thread(target=transfer.send_tree, args=(framed[0], tmp_path / "src"))
    sender.start()
    received = receive_tree(framed[1], tmp_path / "dest")
    sender.join()
    assert sorted(f["path"] for f in received) == sorted(files)
    assert _tree(tmp_path / "dest") == files


def test_a_chunk_that_fails_verification_fails_the_transfer_and_leaves_no_file(tmp_path, framed):
    client, server = framed
    body = os.urandom(1 << 20)

    def send() -> None:
        client.send({"file": "a.pt", "size": 2 * len(body)})
        client.send_bytes(body)  # a genuine first chunk: written to the partial file
        with contextlib.suppress(OSError):  # the second, with a tag not made with the key
            client.sock.sendall(wire._HEADER.pack(len(body)) + bytes(wire.TAG_BYTES) + body)

    sender = threading.Thread(target=send)
    sender.start()
    with pytest.raises(wire.AuthenticationError, match="a chunk of a.pt failed verification"):
        receive_tree(server, tmp_path / "dest")
    sender.join()
    assert list((tmp_path / "dest").iterdir()) == []  # neither a.pt nor a.pt.partial


def test_a_chunk_longer_than_its_file_declared_is_refused_before_it_is_read(tmp_path, framed):
    sender = _replay(framed[0], [{"file": "a.pt", "size": 3}, b"abcd"])
    with pytest.raises(TransferError, match="a.pt is larger than the 3 bytes it declared"):
        receive_tree(framed[1], tmp_path / "dest")
    sender.join()
    assert list((tmp_path / "dest").iterdir()) == []


def test_a_stream_cut_midway_leaves_no_file(tmp_path, framed):
    sender = _replay(framed[0], [{"file": "a.pt", "size": 3}, b"ab", ConnectionResetError("the task went away")])
    with pytest.raises(ConnectionError):
        receive_tree(framed[1], tmp_path / "dest")
    sender.join()
    assert list((tmp_path / "dest").iterdir()) == []


def test_a_write_error_on_the_driver_reaches_the_receiver(tmp_path, framed):
    (tmp_path / "dest" / "a.pt.partial").mkdir(parents=True)  # the receiver cannot open its file
    sender = _replay(framed[0], [{"file": "a.pt", "size": 1}, b"x", {"end": True}])
    with pytest.raises(IsADirectoryError):
        receive_tree(framed[1], tmp_path / "dest")
    framed[1].close()
    sender.join()
    assert not (tmp_path / "dest" / "a.pt").exists()
