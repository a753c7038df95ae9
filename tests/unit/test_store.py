"""The artifact store: the layout, the final marker, committed versions and the resume search, each
on local disk (``file://``) and on a real S3 server (``s3://``, ``moto_server`` on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from airflow_provider_horovod import store
from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
from airflow_provider_horovod.runner.records import RUN_MARKER as ENGINE_MARKER
from airflow_provider_horovod.runner.records import Version


def prepare(root, try_number: int):
    return store.prepare_try(str(root), dag_id="d", run_id="r", task_id="t", try_number=try_number)


def put(path, data: bytes) -> None:
    """An object written as a store (or a crashed writer) leaves it: no folders needed."""
    store._put_bytes(path, data)


def local_version(tmp_path: Path, seq: int, files: dict[str, bytes], step: int | None = None) -> tuple[Version, Path]:
    folder = tmp_path / ("local-v%d" % seq)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    manifest = tuple(sorted((rel, len(data)) for rel, data in files.items()))
    return Version(seq=seq, step=step, time=1.0 + seq, size=sum(s for _, s in manifest), files=manifest), folder


def test_try_folder_layout(tmp_path):
    folder = store.prepare_try(str(tmp_path), dag_id="d", run_id="manual__1", task_id="t", try_number=3)
    assert str(folder) == "file://%s/d/manual__1/t/try-3" % tmp_path
    assert folder.is_dir()
    mapped = store.prepare_try(str(tmp_path), dag_id="d", run_id="r", task_id="t", try_number=1, map_index=2)
    assert str(mapped) == "file://%s/d/r/t/map-2/try-1" % tmp_path


def test_unwritable_artifact_root_names_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ArtifactError, match="Cannot write Horovod artifacts under .*a-file.*artifact_root"):
        prepare(blocker, 1)


def test_store_writes_the_marker_last_and_resume_finds_the_newest_committed_checkpoint(tmp_path, artifact_root):
    root = artifact_root
    local = tmp_path / "local"
    (local / "checkpoints").mkdir(parents=True)
    (local / "checkpoints" / "epoch-1.pt").write_bytes(b"one")
    (local / ENGINE_MARKER).write_text(json.dumps({"status": "failed", "complete": True}))
    try1 = prepare(root, 1)
    marker = store.store_try(local, try1, store.TryMarker(status=store.TryStatus.FAILED, complete=False, try_number=1))
    assert marker.status is store.TryStatus.FAILED and marker.stored_files == ("checkpoints/epoch-1.pt",)
    assert json.loads((try1 / store.MARKER).read_text())["try_number"] == 1
    # try 2 died before committing anything: its half-written checkpoint is never offered
    try2 = prepare(root, 2)
    put(try2 / "checkpoints" / "epoch-2.pt", b"half")
    put(try1 / "checkpoints" / "stray.pt", b"not named by try 1's marker")
    try3 = prepare(root, 3)
    found = store.latest_checkpoint(try3, 3)
    assert str(found.path) == str(try1 / "checkpoints") and found.try_number == 1
    local_copy = HorovodRunnerHook().download(found.path, files=found.files)
    try:
        assert sorted(p.name for p in Path(local_copy).iterdir()) == ["epoch-1.pt"]  # what the marker names, only
        assert (Path(local_copy) / "epoch-1.pt").read_bytes() == b"one"
    finally:
        shutil.rmtree(local_copy)
    with pytest.raises(ArtifactError, match="never committed"):
        store.checkpoint_at(str(try2 / "checkpoints"), roots=[str(root)])
    named = store.checkpoint_at(str(try1), roots=[str(root)])
    assert str(named) == str(try1 / "checkpoints") and store.named_files(named) == ("epoch-1.pt",)  # not stray.pt


def test_a_marker_without_complete_true_offers_no_final_checkpoint(artifact_root):
    try1 = prepare(artifact_root, 1)
    put(try1 / "checkpoints" / "half.pt", b"h")
    (try1 / store.MARKER).write_text(json.dumps({"status": "failed", "stored_files": ["checkpoints/half.pt"]}))
    assert store.newest_checkpoint(try1) is None


def test_a_killed_try_offers_its_newest_committed_version_and_prunes_to_keep(tmp_path, artifact_root):
    try1 = prepare(artifact_root, 1)
    for seq in (1, 2, 3):
        version, local = local_version(tmp_path, seq, {"model.pt": b"w" * seq, "step.txt": str(seq).encode()}, step=10 * seq)
        store.commit_version(try1, local, version, keep=2)
    assert [v.seq for v, _ in store.versions(try1)] == [2, 3]  # the oldest pruned after the third committed
    assert not (try1 / "versions" / "000001").exists()  # marker and objects gone, no folder left
    found = store.latest_checkpoint(prepare(artifact_root, 2), 2)
    assert (found.try_number, found.seq, found.step) == (1, 3, 30)
    assert (found.path / "step.txt").read_text() == "3"
    assert "try 1, version 3, step 30" in found.describe()
    assert str(store.checkpoint_at(str(try1), roots=[artifact_root])) == str(found.path)
    assert store.named_files(found.path) == found.files == ("model.pt", "step.txt")


def test_a_version_without_its_marker_is_never_offered(tmp_path, artifact_root):
    try1 = prepare(artifact_root, 1)
    version, local = local_version(tmp_path, 1, {"model.pt": b"one"})
    store.commit_version(try1, local, version, keep=2)
    put(try1 / "versions" / "000002" / "model.pt", b"tw")  # the store failed before the marker
    put(try1 / "versions" / "000003" / "_VERSION.json", b'{"seq": 3, "fi')  # half a marker (a local write cut)
    assert [v.seq for v, _ in store.versions(try1)] == [1]
    assert store.newest_checkpoint(try1).seq == 1


class StateStore:
    """Airflow 3.3's TaskStateStoreAccessor as the operator sees it: get(key, default), set(key, value)."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value, retention=None):
        self.values[key] = json.loads(json.dumps(value))


def test_task_state_store_names_the_newest_version_and_a_pruned_one_falls_back_to_the_scan(tmp_path, artifact_root):
    try1 = prepare(artifact_root, 1)
    version, local = local_version(tmp_path, 1, {"model.pt": b"one"}, step=5)
    path = store.commit_version(try1, local, version, keep=1)
    state = StateStore()
    store.record_checkpoint(state, store.Checkpoint(path, 1, 5, 1))
    found = store.recorded_checkpoint(state, try1.parent)
    assert (str(found.path), found.try_number, found.step, found.files) == (str(path), 1, 5, ("model.pt",))
    second, local2 = local_version(tmp_path, 2, {"model.pt": b"two"}, step=6)
    store.commit_version(try1, local2, second, keep=1)  # version 1 pruned: the record is stale
    assert store.recorded_checkpoint(state, try1.parent) is None
    assert store.recorded_checkpoint(None, try1.parent) is None


def test_metrics_of_a_long_try_are_thinned_evenly_and_keep_the_newest_row():
    rows = ['{"step": %d, "time": %d, "values": {"loss": 1}}' % (i, i) for i in range(1, 100_001)]
    kept = store.parse_metrics(iter(rows + ["{cut", "[]"]), max_rows=500)
    steps = [r["step"] for r in kept]
    assert 250 <= len(steps) <= 501 and steps[0] == 1 and steps[-1] == 100_000 and steps == sorted(steps)
    gaps = {b - a for a, b in zip(steps, steps[1:-1])}
    assert len(gaps) == 1  # evenly spread over the whole try, not only its end
    assert [r["step"] for r in store.parse_metrics(rows[:3], max_rows=500)] == [1, 2, 3]


def rows(steps) -> bytes:
    return "".join('{"step": %d, "time": 1.0, "values": {"loss": 1}}\n' % s for s in steps).encode()


def test_metrics_are_appended_as_new_objects_and_read_back_in_order_from_the_newest_base(artifact_root):
    folder = prepare(artifact_root, 1)
    log = store.MetricsLog(folder)
    log.append(rows(range(0, 2)))
    log.append(rows(range(2, 5)))
    assert [r["step"] for r in store.read_metrics(folder, max_rows=100)] == list(range(5))
    names = sorted(p.name for p in (folder / "metrics").iterdir())
    assert names == ["000001.jsonl", "000002.jsonl"]  # nothing rewritten, nothing renamed
    log.append(rows(range(0, 5, 2)), base=True)  # the recorder thinned its file: the whole of it, kept rows only
    log.append(rows([5]))
    assert [r["step"] for r in store.read_metrics(folder, max_rows=100)] == [0, 2, 4, 5]
    assert sorted(p.name for p in (folder / "metrics").iterdir()) == ["000003.base.jsonl", "000004.jsonl"]


def test_metrics_of_the_old_layout_still_read(artifact_root):
    folder = prepare(artifact_root, 1)
    put(folder / "metrics.jsonl", rows(range(3)) + b'{"step": 3, "ti')  # one file, its last line cut
    assert [r["step"] for r in store.read_metrics(folder, max_rows=100)] == [0, 1, 2]


def test_one_request_per_metrics_commit(s3_server):
    from tests import s3

    folder = prepare(s3.uri(s3_server.new_bucket(), "store"), 1)
    log = store.MetricsLog(folder)
    log.append(rows([0]))  # the first request of a new client also fetches credentials and the like
    sent = []
    folder.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.method))
    for start in range(1, 10, 3):
        log.append(rows(range(start, start + 3)))
    assert sent == ["PUT"] * 3
    log.append(rows(range(10)), base=True)
    assert sent[3:] == ["PUT", "POST"]  # the base, then one bulk delete of the objects before it
    assert [r["step"] for r in store.read_metrics(folder, max_rows=100)] == list(range(10))


class FailingStore:
    """An artifact root that fails for real at one object of a commit, until ``reopen()``: on ``file://``
    the disk fills up at that file (it is a link to ``/dev/full``); on ``s3://`` the server becomes
    unreachable at that key (``tests.s3.Gate`` cuts every connection, as a connection of its own)."""

    def __init__(self, root: str, cause: str, gate=None) -> None:
        self.root, self.cause, self.gate = root, cause, gate

    def fail_at(self, obj) -> None:
        if self.gate is None:
            Path(obj.path).parent.mkdir(parents=True)
            Path(obj.path).symlink_to("/dev/full")
        else:
            self.gate.cut_at = ("/%s" % obj.path.split("/", 1)[1]).encode()  # the key, as the request line names it

    def reopen(self) -> None:
        if self.gate is not None:
            self.gate.reopen()


@pytest.fixture(params=["file", "s3"])
def failing_store(request, tmp_path, monkeypatch):
    if request.param == "file":
        yield FailingStore("file://%s" % (tmp_path / "store"), r"OSError: .*No space left on device")
        return
    from tests import s3

    server = request.getfixturevalue("s3_server")
    gate = s3.Gate(server)
    for name, value in gate.environment().items():
        monkeypatch.setenv(name, value)
    try:
        yield FailingStore(s3.uri(server.new_bucket(), "store", conn_id=gate.conn_id), r".*(Connection|connect)", gate)
    finally:
        gate.close()


def test_a_store_failing_mid_commit_keeps_the_version_before_newest_and_names_the_uri_and_cause(tmp_path,
                                                                                                failing_store):
    try1 = prepare(failing_store.root, 1)
    version, local = local_version(tmp_path, 1, {"model.pt": b"one"})
    store.commit_version(try1, local, version, keep=2)
    second, local2 = local_version(tmp_path, 2, {"a.pt": b"first file goes up", "model.pt": b"two"})
    failing_store.fail_at(try1 / "versions" / "000002" / "model.pt")  # the store fails after the version's first file
    with pytest.raises(ArtifactError, match=r"version 2 to %s/versions/000002 \(%s" % (
            re.escape(str(try1)), failing_store.cause)):
        store.commit_version(try1, local2, second, keep=2)
    failing_store.reopen()
    assert (try1 / "versions" / "000002" / "a.pt").exists()  # half a version is there, but without its marker ...
    assert [v.seq for v, _ in store.versions(try1)] == [1]  # ... so it is never offered
    assert (store.newest_checkpoint(try1).path / "model.pt").read_bytes() == b"one"


@pytest.mark.parametrize(("where", "cause"), [("a file in the way", "Error"), ("no such bucket", "FileNotFoundError: The specified bucket does not exist"),
                                              ("nothing listening", "EndpointConnectionError")])
def test_a_store_that_is_down_when_the_try_starts_fails_it_before_anything_runs(tmp_path, s3_server, monkeypatch, where,
                                                                                 cause):
    from tests import s3

    if where == "a file in the way":
        (tmp_path / "a-file").write_text("not a folder")
        root = str(tmp_path / "a-file")
    elif where == "no such bucket":
        root = s3.uri("hvd-no-such-bucket", "store")
    else:
        monkeypatch.setenv("AIRFLOW_CONN_HVD_S3_DEAD", json.dumps({"conn_type": "aws", "login": "k", "password": "s",
            "extra": {"endpoint_url": "http://127.0.0.1:%d" % s3.free_port(), "region_name": "us-east-1",
                      "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}}))
        root = s3.uri("hvd-artifacts", "store", conn_id="hvd_s3_dead")
    with pytest.raises(ArtifactError, match=r"Cannot write Horovod artifacts under \S*%s \(\w*%s.*artifact_root" % (
            re.escape(root.split("://")[-1]), cause)):
        prepare(root, 1)


WRITER = """
import os, sys, time
from pathlib import Path
from airflow_provider_horovod import store
from airflow_provider_horovod.runner.records import Version
root, local = sys.argv[1], Path(sys.argv[2])
folder = store.prepare_try(root, dag_id="d", run_id="r", task_id="t", try_number=1)
for seq in range(1, 100):
    (local / "step.txt").write_text(str(seq))
    with open(local / "model.pt", "wb") as f:
        f.write(os.urandom(1 << 20) * 32)
    files = (("model.pt", 32 << 20), ("step.txt", len(str(seq))))
    print("uploading", seq, flush=True)
    store.commit_version(folder, local, Version(seq=seq, step=seq, time=time.time(), size=sum(s for _, s in files),
                                                files=files), keep=2)
"""


def test_a_writer_sigkilled_mid_upload_leaves_its_newest_committed_version_whole(tmp_path, artifact_root):
    """The store's half of the SIGKILL test: the process committing versions dies mid-upload (no
    cleanup runs); what a reader finds is the newest version whose marker is there, every object it
    names whole, and a retry resumes from it."""
    import signal
    import subprocess
    import sys
    import time

    local = tmp_path / "local"
    local.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, artifact_root, str(local)], stdout=subprocess.PIPE,
                              text=True, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        for line in writer.stdout:
            if line.strip() == "uploading 3":
                time.sleep(0.05)  # inside version 3's upload (32 MiB): its marker is not there yet
                break
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    try1 = store.try_folder(store.task_folder(artifact_root, "d", "r", "t"), 1)
    committed = store.versions(try1)
    assert [v.seq for v, _ in committed][-1] in (2, 3) and len(committed) >= 1
    if artifact_root.startswith("s3://"):  # 32 MiB to this server takes far longer than 50 ms: killed mid-upload
        assert committed[-1][0].seq == 2
    for version, path in committed:  # every committed version is whole
        assert (path / "step.txt").read_text() == str(version.seq)
        model = path / "model.pt"
        assert model.fs.size(model.path) == 32 << 20
    found = store.latest_checkpoint(prepare(artifact_root, 2), 2)
    assert (found.try_number, found.seq) == (1, committed[-1][0].seq)


BIG = 2 * store.PART_BYTES + (1 << 20)  # a multipart upload on an object store (more than two parts)


def test_a_large_file_goes_up_whole_and_is_listed_at_once(tmp_path, artifact_root):
    """A file over two parts takes the multipart path (s3transfer on s3fs's own credentials, on
    ``s3://``): it arrives byte for byte, and the store's listing sees it at once (the client's
    listing cache is told)."""
    folder = prepare(artifact_root, 1)
    if artifact_root.startswith("s3://"):  # the connection's s3fs client resolves to a transfer-manager client
        client, _ = store._transfer_client(folder.fs)
        assert client is not None
        client.close()
    data = os.urandom(1 << 20) * (BIG >> 20)
    version, local = local_version(tmp_path, 1, {"model.pt": data})
    assert not (folder / "versions").exists()  # listed (and cached) before the upload
    store.commit_version(folder, local, version, keep=1)
    [(committed, path)] = store.versions(folder)
    assert committed.seq == 1 and (path / "model.pt").read_bytes() == data


def test_a_store_failing_during_a_large_file_leaves_no_object_and_no_version(tmp_path, failing_store):
    try1 = prepare(failing_store.root, 1)
    version, local = local_version(tmp_path, 1, {"model.pt": os.urandom(1 << 20) * (BIG >> 20)})
    failing_store.fail_at(try1 / "versions" / "000001" / "model.pt")
    with pytest.raises(ArtifactError, match=r"version 1 to %s/versions/000001 \(%s" % (
            re.escape(str(try1)), failing_store.cause)):
        store.commit_version(try1, local, version, keep=1)
    failing_store.reopen()
    assert store.versions(try1) == []
    if failing_store.gate is not None:  # no half object: a multipart upload is an object only once completed
        assert not (try1 / "versions" / "000001" / "model.pt").exists()
