"""The Horovod view's API app, mounted in Airflow's API server under ``/horovod``.

Every route sits under ``/dags/{dag_id}/runs/{run_id}/tasks/{task_id}`` and depends on Airflow's own
``requires_access_dag("GET", TASK_INSTANCE)``: the caller must be logged in exactly as for the UI (the
UI's ``_token`` cookie, or a bearer token; anonymous: 401) and the auth manager must let them read
that DAG's task instances (else 403). Then :mod:`.store` decides what may be read (400/404).

* ``GET .../tasks/{task_id}``: the page (HTML) the task-instance tab shows;
* ``GET .../tries``: the same facts as JSON;
* ``GET .../metrics``: every try's progress and metrics (``metrics.jsonl``), live while a try runs;
  the page fetches it every few seconds;
* ``GET .../tries/{n}/timeline.svg``: the timeline picture, drawn from ``timeline.json``;
* ``GET .../tries/{n}/files/{path}``: one stored file, as a download.

``map_index`` (query) selects a mapped task instance; ``try_number`` (query) the try the page opens on.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from jinja2 import Environment

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import requires_access_dag

from airflow_provider_horovod.metrics import duration_text, rate
from airflow_provider_horovod.plugins.store import BadRequest, NotFound, TaskArtifacts, Try, roots
from airflow_provider_horovod.runner.events import RunStatus
from airflow_provider_horovod.runner.launchers import no_timeline_hint
from airflow_provider_horovod.runner.messages import Report
from airflow_provider_horovod.runner.wire import ProtocolError
from airflow_provider_horovod.runner import timeline as hvd_timeline
from airflow_provider_horovod.store import CHECKPOINTS, MARKER, TIMELINE, TryMarker

log = logging.getLogger(__name__)

TASK_ROUTE = "/dags/{dag_id}/runs/{run_id}/tasks/{task_id}"
CHUNK = 1 << 20
MAX_CHART_ROWS = 1000  # points per try and metric the page draws (metrics.jsonl thinned evenly)
REFRESH_S = 3  # how often the page fetches .../metrics while a try runs

router = APIRouter(prefix=TASK_ROUTE, dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))])


def _task(dag_id: str, run_id: str, task_id: str, map_index: str | None) -> TaskArtifacts:
    try:
        return TaskArtifacts.find(dag_id, run_id, task_id, _map_index(map_index))
    except BadRequest as err:
        raise HTTPException(400, str(err)) from None


def _try(task: TaskArtifacts, try_number: int) -> Try:
    try:
        return task.get(try_number)
    except NotFound:
        raise HTTPException(404, "No stored artifacts for try %d of this task instance" % try_number) from None


def _map_index(value: str | None) -> int:
    """The UI fills ``{MAP_INDEX}`` only for mapped task instances: anything not an int means -1."""
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1


@router.get("", response_class=HTMLResponse)
def page(dag_id: str, run_id: str, task_id: str, request: Request, map_index: str | None = None,
         try_number: str | None = None) -> HTMLResponse:
    task = _task(dag_id, run_id, task_id, map_index)
    tries = task.tries()
    selected = next((t for t in tries if str(t.number) == (try_number or "")), tries[-1] if tries else None)
    base = request.scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0] or request.url.path
    mi = _map_index(map_index)

    def url(*parts: str, **query: Any) -> str:
        q = {"map_index": mi} if mi >= 0 else {}
        q.update({k: v for k, v in query.items() if v is not None})
        path = "/".join([base, *(quote(p, safe="/") for p in parts)])
        return path + ("?" + urlencode(q) if q else "")

    facts = _facts(selected, running=selected is tries[-1] and not selected.committed) if selected else None
    body = _PAGE.render(
        dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=mi, tries=tries, selected=selected, facts=facts,
        url=url, roots=", ".join(roots()), refresh_s=REFRESH_S, checkpoints=CHECKPOINTS, timeline=TIMELINE, fmt_size=_fmt_size,
    )
    return HTMLResponse(body, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})


@router.get("/tries")
def tries_json(dag_id: str, run_id: str, task_id: str, map_index: str | None = None) -> dict[str, Any]:
    task = _task(dag_id, run_id, task_id, map_index)
    tries = task.tries()
    return {"tries": [_facts(t, running=t is tries[-1] and not t.committed) for t in tries]}


@router.get("/metrics")
def metrics_json(dag_id: str, run_id: str, task_id: str, map_index: str | None = None) -> dict[str, Any]:
    tries = _task(dag_id, run_id, task_id, map_index).tries()
    return {"tries": [_progress(t, running=not t.committed and t is tries[-1]) for t in tries],
            "refresh_s": REFRESH_S}


def _progress(t: Try, *, running: bool) -> dict[str, Any]:
    """One try's reports for the charts, and its progress from the first and the newest of them."""
    rows = t.metrics(MAX_CHART_ROWS)
    out: dict[str, Any] = {"try_number": t.number, "status": RunStatus.RUNNING if running else t.status, "rows": rows,
                           "newest": rows[-1] if rows else None, "elapsed_s": None, "elapsed": None, "steps_per_s": None,
                           "eta_s": None, "eta": None}
    if not rows:
        return out
    try:
        first, newest = (Report.from_json({**row, "metrics": {}}) for row in (rows[0], rows[-1]))
    except ProtocolError:  # a row without a time or with a bad step: charts only
        return out
    speed = rate(first, newest)  # finite or None; report times are bounded (messages.MAX_TIME)
    out["elapsed_s"] = _finite(newest.time - first.time, 1)
    out["elapsed"] = duration_text(newest.time - first.time)  # the page shows durations as the task log does
    out["steps_per_s"] = _finite(speed, 2) if speed else None
    if speed and newest.total_steps and newest.step is not None and running:
        eta = max(0, newest.total_steps - newest.step) / speed
        out["eta_s"], out["eta"] = _finite(eta, 1), duration_text(eta)
    return out


def _finite(value: float | None, digits: int) -> float | None:
    """``value`` rounded, or ``None`` where it is no finite number (JSON has none: a 500 otherwise)."""
    return round(value, digits) if value is not None and math.isfinite(value) else None


@router.get("/tries/{try_number}/timeline.svg")
def timeline_svg(dag_id: str, run_id: str, task_id: str, try_number: int, map_index: str | None = None) -> Response:
    chosen = _try(_task(dag_id, run_id, task_id, map_index), try_number)
    try:
        svg = _pictures.get(chosen, "%s / %s, try %d" % (dag_id, task_id, try_number))
    except NotFound:
        svg = None
    if svg is None:
        raise HTTPException(404, "Try %d stored no timeline this view can draw" % try_number)
    return Response(svg, media_type="image/svg+xml",
                    headers={"Cache-Control": "private, max-age=300", "X-Content-Type-Options": "nosniff"})


@router.get("/tries/{try_number}/files/{path:path}")
def download(dag_id: str, run_id: str, task_id: str, try_number: int, path: str, map_index: str | None = None) -> Response:
    chosen = _try(_task(dag_id, run_id, task_id, map_index), try_number)
    try:
        stored = chosen.open(path)  # on local disk by descriptor: what was checked is what is sent
    except NotFound:
        raise HTTPException(404, "Try %d stored no file %r" % (try_number, path)) from None
    name = path.rsplit("/", 1)[-1]

    def chunks() -> Iterator[bytes]:
        with stored as f:
            while block := f.read(CHUNK):
                yield block

    headers = {"Content-Disposition": "attachment; filename*=UTF-8''%s" % quote(name, safe=""),
               "X-Content-Type-Options": "nosniff", "Cache-Control": "private, no-cache"}
    size = os.fstat(stored.fileno()).st_size if chosen.local else next((f.size for f in chosen.files() if f.path == path), None)
    if size is not None:
        headers["Content-Length"] = str(size)
    media = "application/json" if name.endswith(".json") else "application/octet-stream"
    return StreamingResponse(chunks(), media_type=media, headers=headers)


def _facts(t: Try, *, running: bool) -> dict[str, Any]:
    """What the page shows about one try, from its marker (``running``: the newest try, uncommitted)."""
    marker = t.marker or _UNCOMMITTED
    files = t.files()
    return {
        "try_number": t.number,
        "status": RunStatus.RUNNING if running else t.status,
        "committed": t.committed,
        "np": marker.np,
        "launcher": marker.launcher,
        "duration_s": marker.duration_s,
        "resumed_from": marker.resumed_from,
        "resumed_from_try": marker.resumed_from_try,
        "resumed_from_step": marker.resumed_from_step,
        "versions": t.versions(),
        "attempts": list(marker.attempts) if len(marker.attempts) > 1 else [],  # one attempt: nothing to add
        "artifacts_uri": str(t.folder),
        "files": [{"path": f.path, "size": f.size} for f in files if f.path != MARKER],
        "checkpoints": [{"path": f.path, "size": f.size} for f in files if f.path.startswith(CHECKPOINTS + "/")],
        "timeline": TIMELINE in {f.path for f in files},
        "error": marker.error,
    }


_UNCOMMITTED = TryMarker(status=None, complete=False)


class _Pictures:
    """Drawn timelines, by try folder and commit time: a committed folder never changes."""

    def __init__(self, size: int = 16) -> None:
        self._lock = threading.Lock()
        self._drawing = threading.Lock()
        self._items: OrderedDict[tuple[str, Any], str | None] = OrderedDict()
        self._size = size

    def get(self, t: Try, title: str) -> str | None:
        key = (str(t.folder), t.marker.committed_at if t.marker else None)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        with self._drawing:  # one drawing at a time: its memory is the most one request may cost
            try:
                parsed = t.timeline()
                svg = None if parsed is None else hvd_timeline.render_svg(parsed, title=title)
            except Exception as err:  # noqa: BLE001 - rank 0 wrote the file: whatever it holds, the page answers
                log.warning("The timeline of %s cannot be drawn (%s: %s); remembered as not drawable",
                            t.folder, type(err).__name__, err)
                svg = None  # kept below like a picture: a committed folder never changes
        with self._lock:
            self._items[key] = svg
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return svg


_pictures = _Pictures()


def _fmt_size(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return ("%d %s" % (value, unit)) if unit == "B" else ("%.1f %s" % (value, unit))
        value /= 1024
    return "%d B" % size


def create_app() -> FastAPI:
    app = FastAPI(title="Horovod view", description="Horovod runs of Airflow task instances: timeline, checkpoints, failures.",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(router)
    return app


_JINJA = Environment(autoescape=True)
_JINJA.globals["no_timeline_hint"] = no_timeline_hint  # the launchers' table: what a try without Horovod shows instead
_PAGE = _JINJA.from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Horovod · {{ dag_id }} / {{ task_id }}</title>
<style>
 body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px 20px; color: #1d2733; font-size: 14px; }
 h1 { font-size: 18px; margin: 0 0 2px; } h2 { font-size: 15px; margin: 22px 0 8px; } .sub { color: #5b6673; margin: 0 0 12px; }
 nav a { display: inline-block; padding: 4px 10px; margin: 0 6px 6px 0; border: 1px solid #c7ced6; border-radius: 14px;
         text-decoration: none; color: #1d2733; }
 nav a.selected { background: #1d2733; color: white; border-color: #1d2733; }
 .success { color: #1e7b34; } .failed { color: #b3261e; } .cancelled { color: #8a5a00; }
 nav a.selected.success, nav a.selected.failed, nav a.selected.cancelled { color: white; }
 table { border-collapse: collapse; } td, th { padding: 3px 14px 3px 0; text-align: left; vertical-align: top; }
 th { color: #5b6673; font-weight: 500; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
 code, pre { font-family: ui-monospace, Menlo, monospace; font-size: 12px; }
 pre { background: #f6f8fa; border: 1px solid #e1e5ea; padding: 8px 10px; overflow-x: auto; max-height: 320px; }
 #failure { border-left: 4px solid #b3261e; padding-left: 12px; }
 #timeline-picture { max-width: 100%; height: auto; border: 1px solid #e1e5ea; }
 .muted { color: #5b6673; }
 #progress-bar { width: 420px; height: 14px; } .charts { display: flex; flex-wrap: wrap; gap: 14px; }
 .chart { border: 1px solid #e1e5ea; } .chart text { font-size: 11px; fill: #5b6673; } .legend span { margin-right: 12px; }
 .running { color: #1a5fb4; }
</style></head>
<body>
<h1>Horovod · {{ dag_id }} / {{ task_id }}{% if map_index >= 0 %} [{{ map_index }}]{% endif %}</h1>
<p class="sub">run <code>{{ run_id }}</code></p>
{% if not tries %}
<p id="no-artifacts">This task instance has stored no Horovod artifacts yet (looked under <code>{{ roots }}</code>).</p>
{% else %}
<nav id="tries">{% for t in tries %}{% set shown = "running" if (loop.last and not t.committed) else t.status %}<a href="{{ url(try_number=t.number, chosen=1) }}" data-try="{{ t.number }}"
 class="{{ shown }}{% if t.number == selected.number %} selected{% endif %}">try {{ t.number }} · {{ shown }}</a>{% endfor %}</nav>
<table id="summary">
 <tr><th>status</th><td class="{{ facts.status }}" id="status">{{ facts.status }}</td></tr>
 <tr><th>ranks (np)</th><td id="np">{% if facts.np is none %}?{% elif facts.np < 0 %}{{ facts.np }} <span class="muted">({{ -facts.np }} processes inside the task, no Spark job)</span>{% else %}{{ facts.np }} <span class="muted">(one per Spark barrier task)</span>{% endif %}</td></tr>
 <tr><th>launcher</th><td id="launcher">{{ facts.launcher or "?" }}</td></tr>
 <tr><th>duration</th><td id="duration">{% if facts.duration_s is not none %}{{ "%.1f"|format(facts.duration_s) }} s{% else %}?{% endif %}</td></tr>
 <tr><th>resumed from</th><td id="resumed-from">{% if facts.resumed_from %}<code>{{ facts.resumed_from }}</code>{% if facts.resumed_from_try %} (try {{ facts.resumed_from_try }}{% if facts.resumed_from_step is not none %}, step {{ facts.resumed_from_step }}{% endif %}){% endif %}{% else %}<span class="muted">nothing (started fresh)</span>{% endif %}</td></tr>
 <tr><th>artifact folder</th><td><code id="artifacts-uri">{{ facts.artifacts_uri }}</code></td></tr>
</table>
{% if facts.attempts %}<section><h2>Attempts inside this try</h2>
<p class="muted">A lost executor, host or rank costs a restart of the barrier stage inside the try (max_restarts), from the newest committed version.</p>
<table id="attempts"><tr><th>attempt</th><th>ranks</th><th>resumed from</th><th>restart took</th><th>ended</th><th>why</th></tr>
{% for a in facts.attempts %}<tr><td class="num">{{ a.number }}</td><td class="num">{{ a.np }}</td>
<td>{% if a.resumed_from and a.resumed_from.seq is defined %}version {{ a.resumed_from.seq }}{% if a.resumed_from.step is not none %} (step {{ a.resumed_from.step }}){% endif %}{% elif a.resumed_from %}<code>{{ a.resumed_from.path }}</code>{% else %}<span class="muted">nothing</span>{% endif %}</td>
<td class="num">{% if a.restart_s is not none %}{{ "%.1f"|format(a.restart_s) }} s{% endif %}</td>
<td class="{{ a.ending or '' }}">{{ a.ending or "?" }}</td><td>{{ a.cause or "" }}</td></tr>{% endfor %}</table></section>{% endif %}
{% if not facts.committed %}<p class="muted">This try has not committed its artifacts (it is running, or its worker died before the end).</p>{% endif %}
<section id="progress" data-metrics="{{ url('metrics') }}" data-try="{{ selected.number }}" data-refresh="{{ refresh_s }}">
<h2>Progress and metrics</h2>
<p id="no-metrics" class="muted">No runtime.report() from rank 0 in any try yet.</p>
<div id="progress-live" hidden>
 <p><span id="progress-status"></span> · <progress id="progress-bar" max="1" value="0"></progress> <span id="progress-step"></span></p>
 <table><tr><th>elapsed</th><td id="progress-elapsed"></td><th>ETA</th><td id="progress-eta"></td>
 <th>steps/s</th><td id="progress-rate"></td></tr></table>
 <table id="newest-metrics"></table>
 <p class="legend" id="chart-legend"></p>
 <div class="charts" id="charts"></div>
</div>
</section>
{% if facts.error %}{% set e = facts.error %}
<section id="failure"><h2>Failure{% if e.rank is not none %} of rank {{ e.rank }}{% endif %}{% if e.host %} on {{ e.host }}{% endif %}</h2>
 <p id="failure-message">{{ e.exception or e.message }}{% if e.exit %} ({{ e.exit }}){% endif %}</p>
 {% if e.retry %}<p id="failure-retry">{{ e.retry }}</p>{% endif %}
 {% if e.traceback %}<pre id="failure-traceback">{{ e.traceback }}</pre>{% endif %}
 {% if e.tail %}<h3>Last lines{% if e.rank is not none %} of rank {{ e.rank }}{% endif %}</h3><pre id="failure-tail">{{ e.tail | join("\\n") }}</pre>{% endif %}
 {% if e.launcher_output %}<h3>The launcher's words</h3><pre>{{ e.launcher_output | join("\\n") }}</pre>{% endif %}
</section>{% endif %}
<section><h2>Timeline</h2>
{% if facts.timeline %}
 <p><img id="timeline-picture" alt="Horovod timeline of try {{ selected.number }}" src="{{ url('tries', selected.number|string, 'timeline.svg') }}"></p>
 <p><a id="timeline-download" href="{{ url('tries', selected.number|string, 'files', timeline) }}" download>Download {{ timeline }}</a>
 <span class="muted">— open it in <a href="https://ui.perfetto.dev" target="_blank" rel="noopener">Perfetto</a> or <code>chrome://tracing</code> for every event.</span></p>
{% elif no_timeline_hint(facts.launcher) %}<p class="muted" id="no-timeline">This try ran with <code>launcher="{{ facts.launcher }}"</code>, which runs no Horovod: there is no Horovod timeline: {{ no_timeline_hint(facts.launcher) }}.</p>
{% else %}<p class="muted" id="no-timeline">No timeline was stored for this try (run the task with <code>timeline=True</code>).</p>{% endif %}
</section>
<section><h2>Checkpoints</h2>
{% if facts.checkpoints %}<table id="checkpoints"><tr><th>file</th><th>size</th><th></th></tr>
{% for f in facts.checkpoints %}<tr><td><code>{{ f.path[checkpoints|length + 1:] }}</code></td><td class="num">{{ fmt_size(f.size) }}</td>
<td><a class="download" href="{{ url('tries', selected.number|string, 'files', f.path) }}" download>download</a></td></tr>{% endfor %}</table>
{% elif facts.versions %}<p class="muted" id="no-final-checkpoint">{% if facts.status == "running" %}The try is running: rank 0's checkpoint folder comes as a whole when it ends. The versions committed so far:{% else %}This try ended without storing rank 0's checkpoint folder; the versions committed while it ran:{% endif %}</p>
{% else %}<p class="muted" id="no-checkpoints">Rank 0 stored no checkpoint in this try.</p>{% endif %}
{% if facts.versions %}<table id="versions"><tr><th>version</th><th>step</th><th>size</th><th>files sent</th></tr>
{% for v in facts.versions %}<tr><td class="num">{{ v.seq }}</td><td class="num">{{ v.step if v.step is not none else "" }}</td>
<td class="num">{{ fmt_size(v.size) }}</td><td class="num">{{ v.sent|length }} of {{ v.files|length }}</td></tr>{% endfor %}</table>{% endif %}
</section>
<section><h2>All stored files</h2><table id="files">
{% for f in facts.files %}<tr><td><code>{{ f.path }}</code></td><td class="num">{{ fmt_size(f.size) }}</td>
<td><a class="download" href="{{ url('tries', selected.number|string, 'files', f.path) }}" download>download</a></td></tr>{% endfor %}
</table></section>
{% endif %}
<script>
// Progress and charts from .../metrics, fetched again every few seconds while a try runs (no reload).
(function () {
  var section = document.getElementById("progress");
  if (!section) return;
  var NS = "http://www.w3.org/2000/svg", COLORS = ["#1a5fb4", "#c64600", "#26a269", "#813d9c", "#986a44", "#e01b24"];
  var selected = Number(section.dataset.try), refresh = Number(section.dataset.refresh) * 1000;
  function text(id, value) { document.getElementById(id).textContent = value; }
  function svg(tag, attrs, parent) {
    var el = document.createElementNS(NS, tag);
    for (var k in attrs) el.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(el);
    return el;
  }
  function chart(name, tries) {
    var W = 420, H = 200, L = 48, B = 24, pts = [], lo = Infinity, hi = -Infinity, x0 = Infinity, x1 = -Infinity;
    tries.forEach(function (t, i) {
      var line = t.rows.filter(function (r) { return r.step !== null && typeof r.values[name] === "number"; });
      line.forEach(function (r) { lo = Math.min(lo, r.values[name]); hi = Math.max(hi, r.values[name]);
                                  x0 = Math.min(x0, r.step); x1 = Math.max(x1, r.step); });
      pts.push({t: t, i: i, line: line});
    });
    var box = svg("svg", {width: W, height: H, "class": "chart", "data-metric": name});
    svg("text", {x: L, y: 14}, box).textContent = name;
    if (!isFinite(lo)) return box;
    if (hi === lo) { hi += 0.5; lo -= 0.5; }
    if (x1 === x0) { x1 += 1; }
    function X(v) { return L + (v - x0) / (x1 - x0) * (W - L - 10); }
    function Y(v) { return 22 + (hi - v) / (hi - lo) * (H - B - 22); }
    svg("text", {x: 2, y: Y(hi) + 4}, box).textContent = hi.toPrecision(3);
    svg("text", {x: 2, y: Y(lo) + 4}, box).textContent = lo.toPrecision(3);
    svg("text", {x: L, y: H - 6}, box).textContent = "step " + x0;
    svg("text", {x: W - 80, y: H - 6}, box).textContent = "step " + x1;
    pts.forEach(function (p) {
      if (!p.line.length) return;
      svg("polyline", {fill: "none", stroke: COLORS[p.i % COLORS.length], "stroke-width": 1.5, "data-try": p.t.try_number,
                       points: p.line.map(function (r) { return X(r.step).toFixed(1) + "," + Y(r.values[name]).toFixed(1); }).join(" ")}, box);
    });
    return box;
  }
  function show(data) {
    var tries = data.tries.filter(function (t) { return t.rows.length; });
    document.getElementById("no-metrics").hidden = tries.length > 0;
    document.getElementById("progress-live").hidden = tries.length === 0;
    var mine = data.tries.filter(function (t) { return t.try_number === selected; })[0] || data.tries[data.tries.length - 1];
    var newest = mine && mine.newest;
    text("progress-status", "try " + (mine ? mine.try_number : "?") + ": " + (mine ? mine.status : "?"));
    document.getElementById("progress-status").className = mine ? mine.status : "";
    var bar = document.getElementById("progress-bar");
    if (newest && newest.step !== null && newest.total_steps) {
      bar.value = Math.min(1, newest.step / newest.total_steps);
      text("progress-step", "step " + newest.step + "/" + newest.total_steps + " (" + Math.floor(100 * newest.step / newest.total_steps) + "%)");
    } else { bar.removeAttribute("value"); text("progress-step", newest && newest.step !== null ? "step " + newest.step : ""); }
    text("progress-elapsed", (mine && mine.elapsed) || "–");
    text("progress-eta", (mine && mine.eta) || "–");
    text("progress-rate", mine && mine.steps_per_s ? mine.steps_per_s.toFixed(1) : "–");
    var table = document.getElementById("newest-metrics"); table.textContent = "";
    Object.keys(newest ? newest.values : {}).forEach(function (k) {
      var row = table.insertRow(); row.insertCell().textContent = k; row.insertCell().textContent = newest.values[k].toPrecision(4);
      row.cells[1].className = "num metric-value"; row.dataset.metric = k;
    });
    var names = [];
    tries.forEach(function (t) { t.rows.forEach(function (r) { Object.keys(r.values).forEach(function (k) { if (names.indexOf(k) < 0) names.push(k); }); }); });
    var charts = document.getElementById("charts"); charts.textContent = "";
    names.forEach(function (n) { charts.appendChild(chart(n, data.tries)); });
    var legend = document.getElementById("chart-legend"); legend.textContent = "";
    data.tries.forEach(function (t, i) {
      if (!t.rows.length) return;
      var s = document.createElement("span"); s.style.color = COLORS[i % COLORS.length]; s.textContent = "— try " + t.try_number;
      legend.appendChild(s);
    });
    return data.tries.some(function (t) { return t.status === "running"; });
  }
  function poll() {
    fetch(section.dataset.metrics, {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (data) { if (show(data)) setTimeout(poll, refresh); })
      .catch(function () { setTimeout(poll, refresh * 3); });
  }
  poll();
})();
</script>
<script>
// Inside Airflow's task-instance page, follow the try picked there (?try_number=N) unless one was chosen here.
(function () {
  try {
    if (window.parent === window) return;
    var theirs = new URLSearchParams(window.parent.location.search).get("try_number");
    var mine = new URLSearchParams(window.location.search);
    if (theirs && !mine.has("chosen") && mine.get("try_number") !== theirs) {
      mine.set("try_number", theirs);
      window.location.replace("?" + mine.toString());
    }
  } catch (e) { /* not same-origin: nothing to follow */ }
})();
</script>
</body></html>
""")
