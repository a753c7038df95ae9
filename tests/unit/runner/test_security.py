"""The exec service and the log channel act only on requests signed with the run's secret, and the
driver copies a task's files itself only when it can prove it sees that task's folder."""

from __future__ import annotations

import os
import socket
import time

import pytest

from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.artifacts import make_offer, offer_tree, send_tree, take_tree
from airflow_provider_horovod.runner.channel import Channel, ChannelClient
from airflow_provider_horovod.runner.events import UploadFinished, UploadStarted
from airflow_provider_horovod.runner.mpi import ExecService, orted_argv

SECRET = wire.new_secret()


@pytest.fixture
def service(tmp_path):
    launched = []
    svc = ExecService("127.0.0.1", SECRET, dict(os.environ), os.getpid(), on_launch=launched.append)
    yield svc, launched
    svc.close()


def _hung_up(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _settle(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_exec_service_refuses_a_plain_connection_and_runs_nothing(service):
    svc, launched = service
    with socket.create_connection(("127.0.0.1", svc.port)) as sock:
        sock.recv(wire.NONCE_BYTES)
        sock.sendall(b'{"words": ["orted"]}\n' * 4)
        assert _hung_up(sock)
    _settle(lambda: svc.refused == 1)
    assert svc.refused == 1 and svc.launches == 0 and launched == []


def test_exec_service_refuses_a_wrongly_signed_request_and_runs_nothing(service):
    svc, launched = service
    conn = wire.connect(("127.0.0.1", svc.port), wire.new_secret())
    conn.send({"words": ["orted", "--version"]})
    conn.sock.settimeout(5)
    with pytest.raises(ConnectionError):
        conn.recv()
    _settle(lambda: svc.refused == 1)
    assert svc.refused == 1 and svc.launches == 0 and launched == []


def test_exec_service_starts_nothing_but_orted_even_when_signed(service, tmp_path):
    svc, launched = service
    marker = tmp_path / "pwned"
    conn = wire.connect(("127.0.0.1", svc.port), SECRET)
    conn.send({"words": ["touch", str(marker)]})
    conn.sock.settimeout(5)
    with pytest.raises(ConnectionError):
        conn.recv()
    _settle(lambda: svc.refused == 1)
    assert svc.launches == 0 and not marker.exists()


def test_channel_ignores_frames_not_signed_with_the_secret():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        bad = ChannelClient(address, wire.new_secret())
        bad.send({"t": "logs", "rank": 0, "lines": ["forged"]})
        bad.close()
        good = ChannelClient(address, SECRET)
        good.send({"t": "logs", "rank": 1, "lines": ["genuine"]})
        good.close()
        _settle(lambda: channel.rejected == 1 and channel.tails().get(1) == ["genuine"])
        assert channel.rejected == 1
        assert channel.tails() == {1: ["genuine"]}
    finally:
        channel.close()


def test_a_frame_replayed_on_another_connection_is_refused():
    channel = Channel(SECRET)
    address = channel.start("127.0.0.1")
    try:
        # Record a genuine frame's bytes, then replay them on a new connection (new nonce).
        conn = wire.connect(address, SECRET)
        body = b'{"t": "logs", "rank": 2, "lines": ["once"]}'
        mac = conn._mac(b"c", 0, body)
        frame = wire._HEADER.pack(len(body)) + mac + body
        conn.sock.sendall(frame)
        conn.close()
        with socket.create_connection(address) as sock:
            sock.recv(wire.NONCE_BYTES)
            sock.sendall(frame)
            assert _hung_up(sock)
        _settle(lambda: channel.rejected == 1)
        assert channel.rejected == 1
        assert channel.tails()[2] == ["once"]
    finally:
        channel.close()


def _put(channel: Channel, offer: dict, root) -> str:
    conn = wire.connect(channel.address, SECRET)
    try:
        conn.send({"t": "put"})
        conn.send({"offer": offer})
        mode = conn.recv()["mode"]
        if mode == "stream":
            send_tree(conn, root)
        assert conn.recv()["ok"] is True
        return mode
    finally:
        conn.close()


@pytest.mark.parametrize("forge", ["none", "token", "proof"])
def test_driver_copies_a_tasks_folder_only_when_the_offer_proves_it_sees_it(tmp_path, forge):
    task = tmp_path / "task"
    (task / "artifacts").mkdir(parents=True)
    (task / "artifacts" / "model.bin").write_bytes(os.urandom(1 << 16))
    offer = make_offer(task / "artifacts", task)
    if forge == "token":  # a peer that never wrote the proof file
        offer["token"] = "f" * 64
    elif forge == "proof":  # a proof file this process cannot read (another host, another user)
        offer["proof"] = str(tmp_path / "not-here")
    events = []
    channel = Channel(SECRET, artifact_staging=tmp_path / "staging", on_event=events.append)
    channel.start("127.0.0.1")
    try:
        assert _put(channel, offer, task / "artifacts") == ("copy" if forge == "none" else "stream")
        assert channel.transport == ("copy" if forge == "none" else "stream")
        assert events == [UploadStarted(), UploadFinished(error=None)] and channel.upload_error is None
        assert (tmp_path / "staging" / "model.bin").read_bytes() == (task / "artifacts" / "model.bin").read_bytes()
    finally:
        channel.close()


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_a_task_on_the_drivers_host_copies_resume_from_itself(tmp_path, monkeypatch, transport):
    monkeypatch.setenv("HVDRUNNER_ARTIFACT_TRANSPORT", transport)
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / "epoch-3.pt").write_bytes(os.urandom(1 << 16))
    channel = Channel(SECRET, resume_root=tmp_path / "resume")
    channel.start("127.0.0.1")
    try:
        conn = wire.connect(channel.address, SECRET)
        conn.send({"t": "fetch-resume"})
        mode, files = take_tree(conn, tmp_path / "task" / "resume")
        conn.send({"ok": True, "files": len(files)})
        conn.close()
        assert mode == ("copy" if transport == "auto" else "stream")
        assert (tmp_path / "task" / "resume" / "epoch-3.pt").read_bytes() == (tmp_path / "resume" / "epoch-3.pt").read_bytes()
        proofs = channel._proofs
        assert (proofs is not None) == (transport == "auto")
    finally:
        channel.close()
    assert proofs is None or not proofs.exists()  # the driver's proof files go with the channel


def test_a_task_that_cannot_write_its_proof_file_still_delivers_by_stream(tmp_path):
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "model.bin").write_bytes(b"weights")
    channel = Channel(SECRET, artifact_staging=tmp_path / "staging")
    channel.start("127.0.0.1")
    try:
        conn = wire.connect(channel.address, SECRET)
        conn.send({"t": "put"})
        offer_tree(conn, tmp_path / "artifacts", tmp_path / "no-such-folder")
        conn.close()
        assert channel.transport == "stream"
        assert (tmp_path / "staging" / "model.bin").read_bytes() == b"weights"
    finally:
        channel.close()


def test_orted_command_is_split_without_a_shell():
    words = ["PATH=/usr/bin:$PATH", ";", "export", "PATH", ";", "/usr/bin/orted", "-mca", "orte_hnp_uri",
             '"123.0;tcp://127.0.0.1:5000"', "-mca", "plm", "rsh"]
    assert orted_argv(words) == ["orted", "-mca", "orte_hnp_uri", "123.0;tcp://127.0.0.1:5000", "-mca", "plm", "rsh"]
    with pytest.raises(ValueError, match="other than orted"):
        orted_argv(["rm", "-rf", "/"])


def test_each_exec_service_gives_its_orted_a_session_directory_of_its_own():
    first = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    second = ExecService("127.0.0.1", SECRET, {"PATH": os.environ["PATH"]}, os.getpid())
    dirs = [svc._env["OMPI_MCA_orte_tmpdir_base"] for svc in (first, second)]
    assert dirs[0] != dirs[1] and all(os.path.isdir(d) for d in dirs)
    first.close()
    second.close()
    assert not any(os.path.exists(d) for d in dirs)
