"""Findings N14 and N3 of issue #21, in the Horovod view (it runs in Airflow's API server): a
timeline is parsed as it streams from its file, not held whole in memory; a local store is opened by
descriptor, with no link followed on any component, so a link swapped in after a check serves nothing."""

from __future__ import annotations

import json
import tracemalloc

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
    return view_store.Try(1, store.storage_path(str(folder)), marker)


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
