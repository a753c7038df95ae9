"""What the Horovod view may read: only files a try's marker lists, inside that try's folder."""

from __future__ import annotations

import json
import os

import pytest

from airflow_provider_horovod.plugins.store import BadRequest, NotFound, TaskArtifacts


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", "file://%s" % (tmp_path / "store"))
    monkeypatch.delenv("AIRFLOW__HOROVOD__VIEW_EXTRA_ROOTS", raising=False)
    return tmp_path / "store"


def commit(folder, files: dict[str, bytes], **marker) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    (folder / "_ARTIFACTS.json").write_text(json.dumps({"status": "success", "stored_files": sorted(files), **marker}))


def test_tries_are_read_from_the_layout_the_hook_writes(root):
    task = root / "dag" / "run+1:00" / "train"
    commit(task / "try-1", {"checkpoints/model.pt": b"x" * 10}, status="failed")
    commit(task / "try-2", {"timeline.json": b"[]"})
    (task / "try-3").mkdir()  # running: no marker yet
    tries = TaskArtifacts.find("dag", "run+1:00", "train").tries()
    assert [(t.number, t.status, t.committed) for t in tries] == [
        (1, "failed", True), (2, "success", True), (3, "running or never committed", False)]
    assert [(f.path, f.size) for f in tries[0].files()] == [("checkpoints/model.pt", 10)]
    assert tries[1].timeline().events == 0


def test_a_mapped_task_instance_has_its_own_folder(root):
    commit(root / "dag" / "run" / "train" / "map-3" / "try-1", {"a.txt": b"a"})
    assert [t.number for t in TaskArtifacts.find("dag", "run", "train", map_index=3).tries()] == [1]
    assert TaskArtifacts.find("dag", "run", "train").tries() == []


@pytest.mark.parametrize("bad", ["..", ".", "", "a/b", "a\\b", "a\x00b"])
def test_ids_must_be_one_path_component(root, bad):
    with pytest.raises(BadRequest):
        TaskArtifacts.find("dag", bad, "train")


def test_only_listed_files_are_served(root):
    folder = root / "dag" / "run" / "train" / "try-1"
    commit(folder, {"checkpoints/model.pt": b"m"})
    (folder / "unlisted.bin").write_bytes(b"u")
    chosen = TaskArtifacts.find("dag", "run", "train").get(1)
    assert chosen.file("checkpoints/model.pt").read_bytes() == b"m"
    for rel in ("unlisted.bin", "_ARTIFACTS.json", "../try-1/checkpoints/model.pt", "/etc/passwd", "checkpoints"):
        with pytest.raises(NotFound):
            chosen.file(rel)


def test_a_marker_cannot_list_its_way_out(root, tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    folder = root / "dag" / "run" / "train" / "try-1"
    folder.mkdir(parents=True)
    (folder / "_ARTIFACTS.json").write_text(json.dumps({"stored_files": ["../../../../../secret.txt", "/etc/passwd", "a/./b"]}))
    chosen = TaskArtifacts.find("dag", "run", "train").get(1)
    assert chosen.listed() == [] and chosen.files() == []


def test_symlinks_are_refused_for_files_tries_and_tasks(root, tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    task = root / "dag" / "run" / "train"
    commit(task / "try-1", {"ok.txt": b"ok"})
    os.symlink(tmp_path / "secret.txt", task / "try-1" / "model.pt")
    marker = json.loads((task / "try-1" / "_ARTIFACTS.json").read_text())
    (task / "try-1" / "_ARTIFACTS.json").write_text(json.dumps({**marker, "stored_files": ["model.pt", "ok.txt"]}))
    elsewhere = tmp_path / "elsewhere"
    commit(elsewhere, {"model.pt": b"secret"})
    os.symlink(elsewhere, task / "try-2")
    os.symlink(task, root / "dag" / "run" / "linked")

    tries = TaskArtifacts.find("dag", "run", "train").tries()
    assert [t.number for t in tries] == [1]
    assert [f.path for f in tries[0].files()] == ["ok.txt"]
    with pytest.raises(NotFound):
        tries[0].file("model.pt")
    with pytest.raises(NotFound):
        TaskArtifacts.find("dag", "run", "train").get(2)
    assert TaskArtifacts.find("dag", "run", "linked").folder is None


def test_a_task_that_stored_nothing_has_no_tries(root):
    artifacts = TaskArtifacts.find("dag", "run", "nothing")
    assert artifacts.folder is None and artifacts.tries() == []
    with pytest.raises(NotFound):
        artifacts.get(1)


def test_a_killed_try_shows_its_committed_versions(root):
    folder = root / "dag" / "run" / "train" / "try-1"
    version = folder / "versions" / "000003"
    version.mkdir(parents=True)
    (version / "model.pt").write_bytes(b"m")
    (version / "_VERSION.json").write_text(json.dumps(
        {"seq": 3, "step": 30, "time": 1.0, "size": 1, "files": [{"path": "model.pt", "size": 1}], "sent": ["model.pt"]}))
    (folder / "versions" / "000004").mkdir()  # no marker: not committed, not shown
    [only] = TaskArtifacts.find("dag", "run", "train").tries()
    assert not only.committed
    assert [(v["seq"], v["step"], v["size"]) for v in only.versions()] == [(3, 30, 1)]


def test_a_running_try_shows_its_live_metrics_and_a_linked_metrics_file_is_not_read(root, tmp_path):
    from airflow_provider_horovod.plugins.view import _progress

    task = root / "dag" / "run" / "train"
    commit(task / "try-1", {"timeline.json": b"[]"}, status="failed")
    (task / "try-1" / "metrics.jsonl").write_text(
        '{"step": 0, "total_steps": 100, "time": 10.0, "values": {"loss": 2.0}}\n'
        '{"step": 40, "total_steps": 100, "time": 30.0, "values": {"loss": 1.0}}\n')
    (task / "try-2").mkdir()
    (task / "try-2" / "metrics.jsonl").write_text(
        '{"step": 40, "total_steps": 100, "time": 50.0, "values": {"loss": 1.0, "acc": 0.5}}\n'
        '{"step": 60, "total_steps": 100, "time": 60.0, "values": {"loss": 0.8, "acc": 0.6}}\n{"step": 61, "ti')
    first, second = TaskArtifacts.find("dag", "run", "train").tries()
    live = _progress(second, running=True)
    assert (live["status"], live["newest"]["step"], live["elapsed_s"], live["steps_per_s"], live["eta_s"]) == \
        ("running", 60, 10.0, 2.0, 20.0)
    assert (live["elapsed"], live["eta"]) == ("10s", "20s")  # as the task log's progress line says them
    done = _progress(first, running=False)
    assert (done["status"], [r["step"] for r in done["rows"]], done["eta_s"]) == ("failed", [0, 40], None)
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"step": 1, "time": 1.0, "values": {"leak": 1}}\n')
    (task / "try-2" / "metrics.jsonl").unlink()
    (task / "try-2" / "metrics.jsonl").symlink_to(secret)
    assert second.metrics(10) == []


def test_the_view_reads_what_the_store_wrote_on_local_disk_and_on_s3(artifact_root, tmp_path, monkeypatch):
    """The view over a store written by the store's own code (versions, live metrics, the try's
    marker), once on ``file://`` and once on ``s3://``: it shows only what markers name."""
    from airflow_provider_horovod import store
    from airflow_provider_horovod.plugins.view import _progress
    from airflow_provider_horovod.runner.records import Version

    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", artifact_root)
    try1 = store.prepare_try(artifact_root, dag_id="dag", run_id="run", task_id="train", try_number=1)
    local = tmp_path / "v"
    local.mkdir()
    (local / "model.pt").write_bytes(b"m" * 7)
    for seq in (1, 2):
        store.commit_version(try1, local, Version(seq=seq, step=10 * seq, time=1.0, size=7, files=(("model.pt", 7),)),
                             keep=2)
    store._put_bytes(try1 / "versions" / "000003" / "model.pt", b"half")  # an upload cut before its marker
    metrics = store.MetricsLog(try1)
    metrics.append(b'{"step": 0, "total_steps": 100, "time": 10.0, "values": {"loss": 2.0}}\n')
    metrics.append(b'{"step": 20, "total_steps": 100, "time": 20.0, "values": {"loss": 1.0}}\n')
    [running] = TaskArtifacts.find("dag", "run", "train").tries()
    assert not running.committed and [v["seq"] for v in running.versions()] == [1, 2]
    assert _progress(running, running=True)["steps_per_s"] == 2.0

    engine = tmp_path / "engine"
    (engine / "checkpoints").mkdir(parents=True)
    (engine / "checkpoints" / "final.pt").write_bytes(b"final")
    (engine / "timeline.json").write_bytes(b"[]")
    store.store_try(engine, try1, store.TryMarker(status=store.TryStatus.SUCCESS, complete=False, try_number=1))
    store._put_bytes(try1 / "checkpoints" / "stray.pt", b"not named by the marker")
    [done] = TaskArtifacts.find("dag", "run", "train").tries()
    assert done.committed and done.status == "success"
    assert [(f.path, f.size) for f in done.files()] == [("checkpoints/final.pt", 5), ("timeline.json", 2)]
    assert done.file("checkpoints/final.pt").read_bytes() == b"final" and done.timeline().events == 0
    with pytest.raises(NotFound):
        done.file("checkpoints/stray.pt")
    with pytest.raises(NotFound):
        done.file("versions/000003/model.pt")
    assert [r["step"] for r in done.metrics(100)] == [0, 20]
