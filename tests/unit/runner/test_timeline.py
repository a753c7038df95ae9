"""The timeline picture: lanes over wall time, per-operation totals, rank-ready markers as ticks."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from airflow_provider_horovod.runner.timeline import WAITING_FOR_RANKS, parse, render_svg


def horovod_events() -> list[dict]:
    """What Horovod writes for two tensors on two ranks: negotiation with rank-ready markers, then the op."""
    return [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.grad.w"}},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 1000, "pid": 1},
        {"ph": "X", "name": "0", "ts": 1001, "pid": 1, "dur": 0},
        {"ph": "X", "name": "1", "ts": 4001, "pid": 1, "dur": 0},  # rank 1 was 3 ms late
        {"ph": "E", "ts": 4002, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 4100, "pid": 1},
        {"ph": "B", "name": "MPI_ALLREDUCE", "ts": 4110, "pid": 1},
        {"ph": "E", "ts": 5110, "pid": 1},
        {"ph": "E", "ts": 5200, "pid": 1, "args": {"dtype": "float32", "shape": "[10]"}},
        {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "allreduce.grad.b"}},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 6000, "pid": 2},
        {"ph": "X", "name": "0", "ts": 6001, "pid": 2, "dur": 0},
        {"ph": "X", "name": "1", "ts": 6101, "pid": 2, "dur": 0},
        {"ph": "E", "ts": 6102, "pid": 2},
        {"ph": "B", "name": "ALLREDUCE", "ts": 6200, "pid": 2},  # never closed: the run died here
        {"ph": "B", "name": "MPI_ALLREDUCE", "ts": 6210, "pid": 2},
        {"ph": "E", "ts": 11000, "pid": 2},
    ]


def test_rank_ready_markers_are_not_operations_but_the_wait_for_the_last_rank():
    timeline = parse(horovod_events())
    totals = {row.name: row for row in timeline.totals()}
    assert "0" not in totals and "1" not in totals  # the stray rows of the old picture
    assert set(totals) == {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", WAITING_FOR_RANKS}
    assert totals[WAITING_FOR_RANKS].count == 2
    assert totals[WAITING_FOR_RANKS].total_ms == (3000 + 100) / 1000
    assert [(lane, rank) for lane, rank, _ in timeline.ready] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_operations_are_timed_spans_and_an_unclosed_one_ends_with_the_timeline():
    timeline = parse(horovod_events())
    assert (timeline.start, timeline.end, timeline.wall_us) == (1000, 11000, 10000)
    assert timeline.lanes == {1: "allreduce.grad.w", 2: "allreduce.grad.b"}
    spans = {(s.lane, s.name): s for s in timeline.spans}
    assert (spans[1, "ALLREDUCE"].duration, spans[1, "ALLREDUCE"].depth) == (1100, 0)
    assert (spans[1, "MPI_ALLREDUCE"].duration, spans[1, "MPI_ALLREDUCE"].depth) == (1000, 1)
    still_open = spans[2, "ALLREDUCE"]
    assert (still_open.open, still_open.end, still_open.depth) == (True, 11000, 0)
    assert timeline.busiest_lanes() == [2, 1]  # 4.8 ms + 0.1 ms busy against 3 ms + 1.1 ms


def test_picture_draws_lanes_over_time_with_ticks_and_totals_beside(tmp_path):
    svg = render_svg(parse(horovod_events()), title="dag / train, try 1")
    root = ET.fromstring(svg)  # well-formed SVG
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    joined = " ".join(texts)
    assert "allreduce.grad.w" in joined and "allreduce.grad.b" in joined  # one lane per tensor
    assert "Time per operation" in joined and WAITING_FOR_RANKS in joined
    assert not any(re.fullmatch(r"[01]", t.strip()) for t in texts if t)  # no row named 0 or 1
    assert "10 ms" in joined or "8 ms" in joined  # a time axis in wall time
    ticks = [line for line in root.iter("{http://www.w3.org/2000/svg}line") if "ready" in "".join(line.itertext())]
    assert len(ticks) == 4
    # bars sit where their time is: the ALLREDUCE of lane 1 (4.1-5.2 ms) is left of lane 2's (6.2-11 ms)
    bars = {r.findtext("{http://www.w3.org/2000/svg}title"): float(r.get("x")) for r in root.iter("{http://www.w3.org/2000/svg}rect")
            if r.findtext("{http://www.w3.org/2000/svg}title")}
    first = next(x for title, x in bars.items() if title.startswith("ALLREDUCE: 1.1 ms"))
    second = next(x for title, x in bars.items() if title.startswith("ALLREDUCE:") and "never finished" in title)
    assert first < second


def test_a_long_timeline_stays_a_small_picture():
    events = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": "t%d" % p}} for p in range(40)]
    for step in range(3000):
        for p in range(40):
            t = step * 1000 + p * 10
            events += [{"ph": "B", "name": "ALLREDUCE", "ts": t, "pid": p}, {"ph": "E", "ts": t + 5, "pid": p}]
    svg = render_svg(parse(events))
    assert svg.count("<rect") < 14 * 700  # merged per pixel, 14 lanes drawn
    assert "+ 26 more tensors" in svg


def test_an_empty_timeline_says_so():
    assert "No operations were recorded" in render_svg(parse([]))
