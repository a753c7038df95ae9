"""Findings N14 and N3 of issue #21, in the Horovod view (it runs in Airflow's API server): a
timeline is parsed as it streams from its file, not held whole in memory; a local store is opened by
descriptor, with no link followed on any component, so a link swapped in after a check serves nothing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tracemalloc

import pytest

from airflow_provider_horovod import store
from airflow_provider_horovod.plugins import store as view_store


def _horovod_timeline(size: int) -> bytes:
    """A timeline as Horovod writes one: a negotiation, then an allreduce with its MPI step, per tensor."""
    lines, total, i = [], 0, 0
    while total < size:
        pid, ts = i % 40, i * 10
        for name, ph, at in (("NEGOTIATE_ALLREDUCE", "B", 0), ("NEGOTIATE_ALLREDUCE", "E", 3), ("ALLREDUCE", "B", 4),
                             ("MPI_ALLREDUCE", "B", 5), ("MPI_ALLREDUCE", "E", 6), ("ALLREDUCE", "E", 7)):
            lines.append(json.dumps({"name": name, "ph": ph, "pid": pid, "ts": ts + at}))
            total += len(lines[-1]) + 2
        i += 1
    return ("[\n" + ",\n".join(lines) + "\n]\n").encode()


def _committed_try(folder, files: dict[str, bytes]) -> view_store.Try:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    marker = {"status": "success", "complete": True, "stored_files": sorted(files)}
    (folder / store.MARKER).write_text(json.dumps(marker))
    return view_store.Try(1, store.storage_path(str(folder)), store.TryMarker.from_json(marker))


def test_drawing_a_timeline_costs_the_api_server_less_memory_than_twice_its_size(tmp_path):
    data = _horovod_timeline(8 << 20)
    one_try = _committed_try(tmp_path / "try-1", {store.TIMELINE: data})
    _committed_try(tmp_path / "try-0", {store.TIMELINE: b"[]"}).timeline()  # what a first read imports is not counted
    tracemalloc.start()
    try:
        parsed = one_try.timeline()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert parsed is not None and parsed.events == data.count(b'"ph"')
    assert peak < 2 * len(data), "drawing an %d MiB timeline took %d MiB" % (len(data) >> 20, peak >> 20)


def test_a_timeline_over_the_drawing_cap_is_not_read_at_all(tmp_path, monkeypatch):
    monkeypatch.setattr(view_store, "MAX_TIMELINE_BYTES", 1 << 10)
    one_try = _committed_try(tmp_path / "try-1", {store.TIMELINE: _horovod_timeline(2 << 10)})
    assert one_try.timeline() is None


@pytest.fixture
def task_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__HOROVOD__ARTIFACT_ROOT", "file://%s" % (tmp_path / "store"))
    monkeypatch.delenv("AIRFLOW__HOROVOD__VIEW_EXTRA_ROOTS", raising=False)
    (tmp_path / "jwt_secret").write_text("the API server's secret")
    (tmp_path / "elsewhere" / "checkpoints").mkdir(parents=True)
    (tmp_path / "elsewhere" / "checkpoints" / "model.pt").write_text("the API server's secret")
    return tmp_path / "store" / "dag" / "run" / "train"


def _download(rel: str) -> tuple[int, bytes]:
    from fastapi import HTTPException

    from airflow_provider_horovod.plugins import view

    async def body(response) -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    try:
        response = view.download("dag", "run", "train", 1, rel)
    except HTTPException as err:
        return err.status_code, b""
    return 200, asyncio.run(body(response))


@pytest.mark.parametrize("swapped", ["checkpoints/model.pt", "checkpoints"])
def test_a_link_swapped_in_after_the_views_check_serves_nothing(task_folder, monkeypatch, swapped):
    """The race of N3, won at the exact point: the listed file (or the folder on its way) becomes a
    link to a secret of the API server's user between the view's check and its read."""
    _committed_try(task_folder / "try-1", {"checkpoints/model.pt": b"weights"})
    target = task_folder.parent.parent.parent.parent / ("jwt_secret" if swapped.endswith(".pt") else "elsewhere/checkpoints")
    checked = view_store.Try.file

    def check_then_swap(self, rel):
        path = checked(self, rel)
        victim = task_folder / "try-1" / swapped
        shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
        os.symlink(target, victim)
        return path

    monkeypatch.setattr(view_store.Try, "file", check_then_swap)
    status, body = _download("checkpoints/model.pt")
    assert b"secret" not in body
    assert status == 404


def test_a_local_file_is_downloaded_from_the_descriptor_the_view_checked(task_folder):
    _committed_try(task_folder / "try-1", {"checkpoints/model.pt": b"weights"})
    assert _download("checkpoints/model.pt") == (200, b"weights")
