"""Horovod's timeline, read and drawn: lanes over wall time, with the per-operation totals beside them.

Horovod writes a Chrome trace (``HOROVOD_TIMELINE``): one "process" per tensor (``ph: M`` names it),
``B``/``E`` pairs for each operation on that tensor (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``,
``MPI_ALLREDUCE`` nested inside, ...), and, inside each negotiation, one zero-length ``X`` event per
rank named by the rank's number (``"0"``, ``"1"``): the moment that rank was ready. Those markers are
not operations. Here they become what they mean: ticks on the lane, and the time the first-ready
rank waited for the last one ("waiting for ranks"), which is where a stalled rank shows.

Pure functions, no Airflow: the view (``plugins/``) reads ``timeline.json`` from any store and calls
:func:`parse` and :func:`render_svg`. At the run's end the driver repairs the file Horovod left
(closing an array a dying rank left open) and writes its summary and picture beside it
(:func:`draw_timeline`).
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import dataclasses
import html
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_horovod.runner import records

WAITING_FOR_RANKS = "waiting for ranks"

# Operation name (prefix) -> colour; the first match wins.
_COLOURS = (
    ("NEGOTIATE", "#b8b8b8"),
    ("WAIT_FOR", "#f0a04b"),
    ("QUEUE", "#f0a04b"),
    ("MEMCPY", "#a47148"),
    ("ALLOCATE", "#c9a66b"),
    ("NCCL", "#2f6fb7"),
    ("MPI_ALLREDUCE", "#2f6fb7"),
    ("GLOO_ALLREDUCE", "#2f6fb7"),
    ("ALLREDUCE", "#5b8fd6"),
    ("ALLGATHER", "#4caf7a"),
    ("MPI_ALLGATHER", "#2e8b57"),
    ("BROADCAST", "#9467bd"),
    ("MPI_BCAST", "#7a4ea6"),
    ("ALLTOALL", "#d6617a"),
    ("REDUCESCATTER", "#c45c9a"),
)
_OTHER_COLOUR = "#7fb8d4"


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One operation on one tensor, in microseconds from the timeline's start."""

    lane: int
    name: str
    start: float
    end: float
    depth: int  # 0: the operation itself; 1+: a step nested inside it
    open: bool = False  # never closed (the run ended inside it)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class OperationTotal:
    name: str
    count: int
    total_ms: float
    share_of_wall: float


@dataclasses.dataclass
class Timeline:
    """A parsed timeline. ``lanes``: lane id -> tensor name; times in microseconds."""

    lanes: dict[int, str]
    spans: list[Span]
    ready: list[tuple[int, int, float]]  # (lane, rank, time): a rank was ready in a negotiation
    start: float
    end: float
    events: int

    @property
    def wall_us(self) -> float:
        return max(self.end - self.start, 0.0)

    def busy_us(self) -> dict[int, float]:
        """Per lane: the time its operations took (nested steps not counted twice)."""
        busy: dict[int, float] = {}
        for s in self.spans:
            if s.depth == 0:
                busy[s.lane] = busy.get(s.lane, 0.0) + s.duration
        return busy

    def busiest_lanes(self) -> list[int]:
        busy = self.busy_us()
        return sorted(busy, key=lambda lane: (-busy[lane], lane))

    def rank_wait_us(self) -> tuple[int, float]:
        """How many negotiations waited for a rank, and for how long in all (first ready -> last ready)."""
        negotiations: dict[int, list[Span]] = {}
        for s in self.spans:
            if s.depth == 0 and s.name.startswith("NEGOTIATE"):
                negotiations.setdefault(s.lane, []).append(s)
        starts = {}
        for lane, spans in negotiations.items():
            spans.sort(key=lambda s: s.start)
            starts[lane] = [s.start for s in spans]
        seen: dict[tuple[int, int], list[float]] = {}
        for lane, _rank, ts in self.ready:
            i = bisect.bisect_right(starts.get(lane, []), ts) - 1
            if i >= 0 and ts <= negotiations[lane][i].end:
                seen.setdefault((lane, i), []).append(ts)
        waits = [max(times) - min(times) for times in seen.values() if len(times) > 1]
        return len(waits), sum(waits)

    def totals(self) -> list[OperationTotal]:
        """Per operation: count, total time and share of wall time, longest first; then the rank wait."""
        rows: dict[str, list[float]] = {}
        for s in self.spans:
            row = rows.setdefault(s.name, [0, 0.0])
            row[0] += 1
            row[1] += s.duration
        wall = self.wall_us
        out = [
            OperationTotal(name, int(n), round(total / 1000, 3), round(total / wall, 4) if wall else 0.0)
            for name, (n, total) in sorted(rows.items(), key=lambda kv: (-kv[1][1], kv[0]))
        ]
        waited, total = self.rank_wait_us()
        if waited:
            out.append(OperationTotal(WAITING_FOR_RANKS, waited, round(total / 1000, 3), round(total / wall, 4) if wall else 0.0))
        return out


READ_CHUNK = 1 << 20
MAX_EVENT_CHARS = 1 << 20  # one event of Horovod's is a few hundred bytes
_DECODER = json.JSONDecoder()


class _Buffer:
    """Text of a UTF-8 file, read a chunk at a time, with what is already decoded dropped."""

    def __init__(self, f: BinaryIO) -> None:
        self._f, self._utf8 = f, codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.eof = "", 0, False

    def more(self) -> None:
        """Read the next chunk; ``ValueError`` at the end of the file or past ``MAX_EVENT_CHARS`` pending."""
        if self.eof or len(self.text) - self.pos > MAX_EVENT_CHARS:
            raise ValueError("the timeline ends inside an event, or holds an event over %d characters" % MAX_EVENT_CHARS)
        data = self._f.read(READ_CHUNK)
        self.eof = not data
        self.text = self.text[self.pos:] + self._utf8.decode(data, final=self.eof)
        self.pos = 0

    def next_char(self) -> str:
        """The next character that is not white space (without taking it); ``ValueError`` at the end."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            self.more()

    def value(self) -> Any:
        """The JSON value that starts here, read whole (a number cut by a chunk's end is not taken)."""
        while True:
            try:
                found, end = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                if self.eof:
                    raise
                self.more()
                continue
            if end == len(self.text) and not self.eof:
                self.more()
                continue
            self.pos = end
            return found


def iter_events(f: BinaryIO) -> Iterator[Any]:
    """The elements of the JSON array in the file ``f``, one at a time: in memory at once are a chunk
    and one event, never the whole file. Not an array: nothing. Not JSON, or cut: ``ValueError``."""
    buf = _Buffer(f)
    try:
        if buf.next_char() != "[":
            return
    except ValueError:
        return  # an empty file
    buf.pos += 1
    if buf.next_char() == "]":
        return
    while True:
        buf.next_char()
        yield buf.value()
        after = buf.next_char()
        if after == "]":
            return
        if after != ",":
            raise ValueError("the timeline's events are not separated by commas")
        buf.pos += 1


def parse(events: Iterable[dict[str, Any]]) -> Timeline:
    """A timeline from Horovod's Chrome-trace events (as :func:`load_timeline` returns them).

    A ``B`` left open by a run that died is closed at the last timestamp and marked ``open``.
    """
    lanes: dict[int, str] = {}
    spans: list[Span] = []
    ready: list[tuple[int, int, float]] = []
    stacks: dict[int, list[tuple[str, float]]] = {}
    first, last = math.inf, -math.inf  # the earliest and latest timestamps (not a list of all of them)
    seen_names: dict[str, str] = {}  # one string per operation name, however many spans carry it
    count = 0
    for e in events:
        if not isinstance(e, dict):
            continue
        count += 1
        ph, pid = e.get("ph"), _int(e.get("pid"))
        if ph == "M":
            if e.get("name") == "process_name" and isinstance(e.get("args"), dict) and "name" in e["args"]:
                lanes[pid] = str(e["args"]["name"])
            continue
        ts = _float(e.get("ts"))
        if ts is None:
            continue
        first, last = min(first, ts), max(last, ts)
        if ph == "B":
            name = str(e.get("name", "?"))
            stacks.setdefault(pid, []).append((seen_names.setdefault(name, name), ts))
        elif ph == "E":
            if stacks.get(pid):
                name, start = stacks[pid].pop()
                spans.append(Span(pid, name, start, ts, len(stacks[pid])))
        elif ph == "X":
            name = str(e.get("name", "?"))
            duration = _float(e.get("dur")) or 0.0
            if name.isdigit() and duration == 0:  # "rank N is ready" inside a negotiation
                ready.append((pid, int(name), ts))
            else:
                spans.append(Span(pid, seen_names.setdefault(name, name), ts, ts + duration, len(stacks.get(pid, ()))))
                last = max(last, ts + duration)
    end = last if last > -math.inf else 0.0
    for pid, stack in stacks.items():
        for depth, (name, start) in enumerate(stack):
            spans.append(Span(pid, name, start, end, depth, open=True))
    start = first if first < math.inf else 0.0
    for pid in {s.lane for s in spans} - set(lanes):
        lanes[pid] = "tensor %d" % pid
    return Timeline(lanes=lanes, spans=spans, ready=ready, start=start, end=end, events=count)


def colour(name: str) -> str:
    for prefix, value in _COLOURS:
        if name.startswith(prefix):
            return value
    return _OTHER_COLOUR


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the parts of the picture go: the lanes' plot on the left, the totals on the right."""

    timeline: Timeline
    shown: list[int]  # the lanes drawn, busiest first
    label_w: int = 170
    plot_w: int = 520
    gap: int = 24
    totals_w: int = 400
    lane_h: int = 22
    top: int = 58
    axis_h: int = 34

    @property
    def width(self) -> int:
        return self.label_w + self.plot_w + self.gap + self.totals_w + 10

    @property
    def plot_h(self) -> int:
        return self.lane_h * max(len(self.shown), 1)

    @property
    def axis_y(self) -> int:
        return self.top + self.plot_h

    @property
    def totals_x(self) -> int:
        return self.label_w + self.plot_w + self.gap

    def x(self, t: float) -> float:
        wall = self.timeline.wall_us
        return self.label_w + (self.plot_w * (t - self.timeline.start) / wall if wall else 0.0)


def render_svg(timeline: Timeline, *, max_lanes: int = 14, max_operations: int = 14, title: str = "Horovod timeline") -> str:
    """An SVG picture: the busiest tensors as lanes over wall time (left), the totals (right).

    Spans narrower than a pixel are merged per lane and colour, so the picture stays small for
    timelines of any length.
    """
    order = timeline.busiest_lanes()
    layout = _Layout(timeline, order[:max_lanes])
    totals = timeline.totals()[:max_operations]
    height = layout.top + max(layout.plot_h + layout.axis_h, 22 + 18 * max(len(totals), 1)) + 40
    out = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
        'font-family="sans-serif" font-size="12" role="img">' % (layout.width, height, layout.width, height),
        "<title>%s</title>" % html.escape(title),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="10" y="22" font-size="15" font-weight="bold">%s</text>' % html.escape(title),
        '<text x="10" y="42" fill="#444">wall time %s, %d tensors, %d events; lanes: the %d busiest tensors over time</text>'
        % (_fmt_us(timeline.wall_us), len(timeline.lanes), timeline.events, len(layout.shown)),
    ]
    out += _svg_lanes(layout)
    out += _svg_axis(layout, hidden=order[len(layout.shown):])
    out += _svg_totals(layout, totals)
    out.append("</svg>")
    return "\n".join(out)


def _svg_lanes(layout: _Layout) -> list[str]:
    """Each shown lane: its name, its spans (merged below a pixel) and the ranks' ready marks."""
    timeline, x0, lane_h = layout.timeline, layout.label_w, layout.lane_h
    out = []
    if not layout.shown:
        out.append('<text x="10" y="%d">No operations were recorded in this timeline.</text>' % (layout.top + 16))
    for row, lane in enumerate(layout.shown):
        y = layout.top + row * lane_h
        if row % 2:
            out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="#f5f7fa"/>' % (x0, y, layout.plot_w, lane_h))
        name = timeline.lanes.get(lane, str(lane))
        out.append(_label(x0 - 8, y + 15, name, 25, 'text-anchor="end"'))
        for depth, cname, a, b, what in _merged(timeline, lane, layout.x):
            inset = 3 + 4 * min(depth, 2)
            out.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s"><title>%s</title></rect>'
                       % (a, y + inset, max(b - a, 0.8), max(lane_h - 2 * inset, 3), cname, html.escape(what)))
        for _lane, rank, ts in (r for r in timeline.ready if r[0] == lane):
            out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#222" stroke-width="1">'
                       '<title>rank %d ready at %s</title></line>'
                       % (layout.x(ts), layout.x(ts), y + 1, y + lane_h - 1, rank, _fmt_us(ts - timeline.start)))
    return out


def _svg_axis(layout: _Layout, hidden: list[int]) -> list[str]:
    """The time axis under the lanes, and how much the lanes not drawn (``hidden``) were busy."""
    wall, x0, plot_w, axis_y = layout.timeline.wall_us, layout.label_w, layout.plot_w, layout.axis_y
    out = ['<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#333"/>' % (x0, x0 + plot_w, axis_y, axis_y)]
    for t in _ticks(wall):
        tx = x0 + (plot_w * t / wall if wall else 0)
        out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#333"/>' % (tx, tx, axis_y, axis_y + 5))
        out.append('<text x="%.1f" y="%d" text-anchor="middle" fill="#333">%s</text>' % (tx, axis_y + 18, _fmt_us(t)))
    out.append('<text x="%d" y="%d" text-anchor="middle" fill="#444">time since the first event</text>'
               % (x0 + plot_w // 2, axis_y + 32))
    if hidden:
        busy = layout.timeline.busy_us()
        out.append('<text x="%d" y="%d" fill="#666">+ %d more tensors (%s busy) not drawn</text>'
                   % (10, axis_y + 32, len(hidden), _fmt_us(sum(busy[lane] for lane in hidden))))
    return out


def _svg_totals(layout: _Layout, totals: list[OperationTotal]) -> list[str]:
    """The time per operation, beside the lanes: a bar each, the time, the count and the share of wall time."""
    tx, top = layout.totals_x, layout.top
    out = ['<text x="%d" y="%d" font-weight="bold">Time per operation</text>' % (tx, top - 18),
           '<text x="%d" y="%d" fill="#666" font-size="11">summed over tensors; share of the %s wall time</text>'
           % (tx, top - 4, _fmt_us(layout.timeline.wall_us))]
    longest = max((r.total_ms for r in totals), default=0.0) or 1.0
    for i, r in enumerate(totals):
        y = top + 8 + i * 18
        bar = 110 * r.total_ms / longest
        fill = "#d62728" if r.name == WAITING_FOR_RANKS else colour(r.name)
        out.append(_label(tx, y + 12, r.name, 22))
        out.append('<rect x="%d" y="%d" width="%.1f" height="12" fill="%s"/>' % (tx + 170, y + 2, max(bar, 1), fill))
        out.append('<text x="%d" y="%d" fill="#333">%s, %d\u00d7%s</text>'
                   % (tx + 170 + 116, y + 12, _fmt_us(r.total_ms * 1000), r.count,
                      ", %.0f%%" % (100 * r.share_of_wall) if r.share_of_wall <= 1 else ""))
    return out


def _label(x: float, y: float, text: str, n: int, attrs: str = "") -> str:
    """A text label, shortened to ``n`` characters; the whole text as its tooltip when shortened."""
    short = _shorten(text, n)
    label = '<text x="%d" y="%d" %s>%s</text>' % (x, y, attrs, html.escape(short))
    return label if short == text else "<g><title>%s</title>%s</g>" % (html.escape(text), label)


def _merged(timeline: Timeline, lane: int, x) -> list[tuple[int, str, float, float, str]]:
    """The lane's spans as pixel intervals, merged where they touch, per depth and colour."""
    groups: dict[tuple[int, str], list[Span]] = {}
    for s in timeline.spans:
        if s.lane == lane:
            groups.setdefault((min(s.depth, 2), colour(s.name)), []).append(s)
    out = []
    for (depth, cname), spans in sorted(groups.items()):
        spans.sort(key=lambda s: s.start)
        current: list[Any] | None = None
        for s in spans:
            a, b = x(s.start), x(s.end)
            if current is not None and a <= current[1] + 0.5:
                current[1] = max(current[1], b)
                current[2].append(s)
                continue
            if current is not None:
                out.append((depth, cname, current[0], current[1], _describe(current[2])))
            current = [a, b, [s]]
        if current is not None:
            out.append((depth, cname, current[0], current[1], _describe(current[2])))
    return out


def _describe(spans: list[Span]) -> str:
    if len(spans) == 1:
        s = spans[0]
        return "%s: %s%s" % (s.name, _fmt_us(s.duration), " (never finished)" if s.open else "")
    names = sorted({s.name for s in spans})
    return "%d spans (%s): %s in all" % (len(spans), ", ".join(names[:3]), _fmt_us(sum(s.duration for s in spans)))


def _ticks(wall_us: float) -> list[float]:
    if wall_us <= 0:
        return [0.0]
    raw = wall_us / 6
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(wall_us // step) + 1)]


def _fmt_us(us: float) -> str:
    if us >= 1_000_000:
        return "%.3g s" % (us / 1_000_000)
    if us >= 1000:
        return "%.3g ms" % (us / 1000)
    return "%.0f \u00b5s" % us


def _shorten(text: str, n: int) -> str:
    """At most ``n`` characters; the middle gives way, so ``...buffer.1`` and ``...buffer.2`` stay apart."""
    if len(text) <= n:
        return text
    head = (n - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (n - 1 - head):]


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# -- the file Horovod wrote, repaired, summed up and drawn beside it --------------------------------
def load_timeline(path: Path) -> list[dict[str, Any]]:
    """Horovod's timeline as a list of events, closing the array if Horovod left it open.

    A run that died mid-write may end in half an event; every whole event before it is kept.
    """
    text = path.read_text(errors="replace")
    with contextlib.suppress(ValueError):
        events = json.loads(text)
        return events if isinstance(events, list) else []
    decoder = json.JSONDecoder()
    events: list[dict[str, Any]] = []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            event, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(event, dict):
            events.append(event)
    return events


def repair_timeline(path: Path) -> list[dict[str, Any]]:
    """Rewrite ``path`` as valid JSON (Chrome trace format); return its events."""
    events = load_timeline(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(events))
    os.replace(tmp, path)
    return events


def summarize(timeline: Timeline) -> dict[str, Any]:
    """Per operation: count, total time and share of the timeline's wall time, longest first, then
    the time ranks waited for each other in negotiations (``waiting for ranks``)."""
    return {
        "schema": records.SCHEMA,
        "wall_ms": round(timeline.wall_us / 1000, 3),
        "events": timeline.events,
        "operations": {t.name: {"count": t.count, "total_ms": t.total_ms, "share_of_wall": t.share_of_wall}
                       for t in timeline.totals()},
    }


def draw_timeline(staging: Path) -> dict[str, Any]:
    """The timeline's summary and picture beside it, for the marker. Rank 0 writes the timeline, so
    one that cannot be parsed (a crafted event) is named in the marker and the commit goes on."""
    try:
        parsed = parse(repair_timeline(staging / records.TIMELINE))
        summary, picture = json.dumps(summarize(parsed), indent=2), render_svg(parsed)
    except (ValueError, OverflowError, TypeError, KeyError, AttributeError, RecursionError) as err:
        return {"timeline": records.TIMELINE, "timeline_error": "%s: %s" % (type(err).__name__, err)}
    (staging / records.SUMMARY).write_text(summary)
    (staging / records.PICTURE).write_text(picture)
    return {"timeline": records.TIMELINE, "timeline_summary": records.SUMMARY, "timeline_picture": records.PICTURE}
