"""Artifacts: rank 0's checkpoints and the Horovod timeline, pulled to the driver and committed.

Files move as a stream of frames over the run's authenticated channel (``send_tree`` /
``receive_tree``), one chunk in memory at a time. When rank 0's task runs on the driver's own host
(``local[N]``, a single-machine cluster, or a folder on storage both see), the task offers its folder
instead: it writes a random token to a private file and sends the file's path and the token over
the channel. Only a driver that reads the same token at that path, so sees the same files as the
same user, copies them itself, in the kernel (``copy_tree``); any other answer falls back to the
stream. Either way the files land in a staging folder inside ``artifact_dir``; ``commit`` moves
them into place and writes ``_ARTIFACTS.json`` *last*. A reader trusts a folder only when that
marker says ``"complete": true``.

The rule training code follows: write a checkpoint under a temporary name (``*.tmp``, or a name
starting with ``.``) and rename it when it is complete. Such files are never pulled, so a
checkpoint being written when the run fails is never offered as complete.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import html
import json
import os
import queue
import secrets
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner import names

MARKER = "_ARTIFACTS.json"
CHUNK = 4 << 20
COPY_CHUNK = 64 << 20  # per copy_file_range call: how often a same-host copy looks for a cancel
TIMELINE = names.TIMELINE_FILE
SUMMARY = "timeline_summary.json"
PICTURE = "timeline.svg"
CHECKPOINTS = names.CHECKPOINTS_DIR


def in_progress(name: str) -> bool:
    """A file that is still being written by the rule above."""
    return name.startswith((".", "~")) or name.endswith((".tmp", ".partial", ".part"))


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and prove a file can be written there; else ``ArtifactError``."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / (".probe-%s" % uuid.uuid4().hex)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ArtifactError(
            "Cannot write artifacts to %s (%s). Choose a folder this process can create and write." % (target, err.strerror or err)
        ) from err
    if (target / MARKER).exists():
        raise ArtifactError(
            "%s already holds the committed artifacts of an earlier run; give each run its own folder." % target
        )
    return target


# -- streaming ------------------------------------------------------------------------------------
def finished_files(root: Path | None) -> list[Path]:
    """Every file under ``root`` that is not still being written, in a stable order."""
    files = []
    if root is not None and root.is_dir():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not in_progress(d))
            files += [Path(dirpath) / name for name in sorted(filenames) if not in_progress(name)]
    return files


def send_tree(conn, root: Path | None) -> int:
    """Send every finished file under ``root``; return how many bytes were sent."""
    sent = 0
    files = finished_files(root)
    for path in files:
        try:
            f = path.open("rb")
        except OSError:
            continue  # removed while we looked
        with f:
            size = os.fstat(f.fileno()).st_size
            conn.send({"file": path.relative_to(root).as_posix(), "size": size})
            buf = bytearray(min(CHUNK, max(size, 1)))
            view = memoryview(buf)
            left = size
            while left > 0:
                n = f.readinto(view[: min(CHUNK, left)])
                if not n:  # truncated under us: keep the promised size
                    n = min(CHUNK, left)
                    view[:n] = bytes(n)
                conn.send_bytes(view[:n])
                left -= n
                sent += n
    conn.send({"end": True, "files": len(files)})
    return sent


class _FileWriter:
    """Writes received chunks in a thread of its own, so the disk works while the next frame arrives.

    At most ``depth`` chunks wait in between, so memory stays bounded. A write error is raised in
    the receiving thread at its next call; ``stop`` abandons whatever is still queued.
    """

    def __init__(self, depth: int = 2) -> None:
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hvdrunner-artifact-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        out = None
        while (item := self._queue.get()) is not None:
            op, arg = item
            if self._error is not None:
                continue  # drain without writing: the receiver raises at its next call
            try:
                if op == "open":
                    out = open(arg, "wb")  # noqa: SIM115 (closed by "close" or on the way out)
                elif op == "write":
                    out.write(arg)
                else:  # "close": (partial, target)
                    out.close()
                    os.replace(*arg)
            except BaseException as err:  # noqa: BLE001 (handed to the receiving thread)
                self._error = err
        if out is not None:
            out.close()

    def put(self, op: str, arg: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((op, arg))

    def finish(self) -> None:
        """Wait until everything queued is on disk; raise the first write error, if any."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Abandon the transfer: let the thread end without writing what is left."""
        self._error = self._error or ConnectionAbortedError("transfer abandoned")
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._queue.put(None)
        self._thread.join()


def receive_tree(conn, dest: Path) -> list[dict[str, Any]]:
    """Receive what ``send_tree`` sends into ``dest``; files appear only when whole."""
    received = []
    dest.mkdir(parents=True, exist_ok=True)
    writer = _FileWriter()
    try:
        while True:
            head = conn.recv()
            if head.get("end"):
                writer.finish()
                return received
            rel = Path(head["file"])
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError("refusing a file outside the artifact folder: %s" % rel)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            writer.put("open", partial)
            left = int(head["size"])
            while left > 0:
                chunk = conn.recv_bytes()
                writer.put("write", chunk)
                left -= len(chunk)
            writer.put("close", (partial, target))
            received.append({"path": rel.as_posix(), "size": int(head["size"])})
    except BaseException:
        writer.stop()
        raise


# -- same-host copy -------------------------------------------------------------------------------
def make_offer(root: Path, proof_dir: Path) -> dict[str, str]:
    """Offer ``root`` to a driver that may see it: a random token in a file only this user can read."""
    token = secrets.token_hex(32)
    proof = proof_dir / ("offer-%s" % secrets.token_hex(8))
    fd = os.open(proof, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return {"root": str(root.absolute()), "proof": str(proof.absolute()), "token": token}


def verify_offer(offer: Any) -> Path | None:
    """The offered folder if this process reads the offer's token at its path; else ``None``."""
    if not isinstance(offer, dict):
        return None
    root, proof, token = offer.get("root"), offer.get("proof"), offer.get("token")
    if not (isinstance(root, str) and isinstance(proof, str) and isinstance(token, str)) or len(token) < 32:
        return None
    if not (os.path.isabs(root) and os.path.isabs(proof)):
        return None
    try:
        with open(proof, "rb") as f:
            seen = f.read(len(token) + 1)
    except OSError:
        return None
    if not hmac.compare_digest(seen, token.encode()):
        return None
    return Path(root)


def _copy_step(how: str, src: int, dst: int) -> int:
    if how == "copy_file_range":
        return os.copy_file_range(src, dst, COPY_CHUNK)
    if how == "sendfile":
        return os.sendfile(dst, src, None, COPY_CHUNK)
    return os.write(dst, os.read(src, CHUNK))


# In the kernel first; each step down is taken when a file system or kernel refuses the one above.
_COPY_WAYS = [w for w in ("copy_file_range", "sendfile") if hasattr(os, w) and sys.platform == "linux"] + ["read"]
_CANNOT_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


def _copy_fd(src: int, dst: int, cancelled: Callable[[], bool], progress: Callable[[int], None]) -> int:
    """Copy ``src`` to ``dst`` from their current positions to the end; return the bytes copied."""
    ways = list(_COPY_WAYS)
    done = 0
    while True:
        if cancelled():
            raise ConnectionAbortedError("the run ended while its artifacts were being copied")
        try:
            n = _copy_step(ways[0], src, dst)
        except OSError as err:
            if len(ways) == 1 or err.errno not in _CANNOT_COPY:
                raise
            ways.pop(0)
            continue
        if not n:
            return done
        done += n
        progress(done)


def copy_tree(root: Path, dest: Path, *, cancelled: Callable[[], bool] = lambda: False,
              progress: Callable[[int], None] = lambda done: None) -> list[dict[str, Any]]:
    """Copy every finished file under ``root`` into ``dest``; files appear only when whole."""
    received = []
    dest.mkdir(parents=True, exist_ok=True)
    for path in finished_files(root):
        rel = path.relative_to(root)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        try:
            src = path.open("rb")
        except FileNotFoundError:
            continue  # removed while we looked
        with src, partial.open("wb") as out:
            size = _copy_fd(src.fileno(), out.fileno(), cancelled, progress)
        os.replace(partial, target)
        received.append({"path": rel.as_posix(), "size": size})
    return received


# -- one transfer, either direction ---------------------------------------------------------------
def offer_tree(conn, root: Path | None, proof_dir: Path | None) -> None:
    """The side that has the files: offer ``root`` (``proof_dir=None``: stream only; ``root=None``:
    an empty stream), stream it if asked, and wait for the taker's receipt; heartbeats and anything
    else before it are ignored."""
    offer = None
    if root is not None and proof_dir is not None:
        with contextlib.suppress(OSError):  # no proof file (disk full, read-only): the stream still works
            offer = make_offer(root, proof_dir)
    conn.send({"offer": offer})
    if conn.recv().get("mode") == "stream":
        send_tree(conn, root)
    while "ok" not in (receipt := conn.recv()):
        pass
    if not receipt["ok"]:
        raise OSError(receipt.get("error") or "the receiver could not store the files")


def take_tree(conn, dest: Path, *, allow_copy: bool = True, cancelled: Callable[[], bool] = lambda: False,
              chosen: Callable[[str], None] = lambda mode: None) -> tuple[str, list[dict[str, Any]]]:
    """The side that wants the files: copy them if the offer proves this process sees them, else
    have them streamed. ``chosen`` hears the way taken before any file moves. Returns the way and
    the files; the receipt is the caller's to send."""
    offer = conn.recv().get("offer")
    local = verify_offer(offer) if allow_copy else None
    mode = "copy" if local is not None else "stream"
    chosen(mode)
    conn.send({"mode": mode})
    if local is None:
        return mode, receive_tree(conn, dest)
    beat = [time.monotonic()]

    def heartbeat(_done: int) -> None:  # the offering side waits for the receipt meanwhile
        if time.monotonic() - beat[0] > 2:
            conn.send({"copying": True})
            beat[0] = time.monotonic()

    return mode, copy_tree(local, dest, cancelled=cancelled, progress=heartbeat)


# -- timeline -------------------------------------------------------------------------------------
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


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per operation or activity name: count, total time and share of the timeline's wall time."""
    stacks: dict[Any, list[tuple[str, float]]] = {}
    totals: dict[str, dict[str, float]] = {}
    stamps = [float(e["ts"]) for e in events if "ts" in e]
    for e in events:
        ph, ts = e.get("ph"), e.get("ts")
        if ts is None:
            continue
        key = (e.get("pid"), e.get("tid"))
        if ph == "B":
            stacks.setdefault(key, []).append((e.get("name", "?"), float(ts)))
        elif ph == "E" and stacks.get(key):
            name, start = stacks[key].pop()
            row = totals.setdefault(name, {"count": 0, "total_us": 0.0})
            row["count"] += 1
            row["total_us"] += float(ts) - start
        elif ph == "X":
            row = totals.setdefault(e.get("name", "?"), {"count": 0, "total_us": 0.0})
            row["count"] += 1
            row["total_us"] += float(e.get("dur", 0))
    wall = (max(stamps) - min(stamps)) if stamps else 0.0
    ops = {
        name: {"count": int(r["count"]), "total_ms": round(r["total_us"] / 1000, 3),
               "share_of_wall": round(r["total_us"] / wall, 4) if wall else 0.0}
        for name, r in sorted(totals.items(), key=lambda kv: -kv[1]["total_us"])
    }
    return {"wall_ms": round(wall / 1000, 3), "events": len(events), "operations": ops}


def render_svg(summary: dict[str, Any], path: Path, top: int = 15) -> None:
    """A bar chart of the summary's total time per operation, readable in any browser."""
    rows = list(summary["operations"].items())[:top]
    width, bar_x, bar_w, row_h = 760, 260, 380, 24
    height = 60 + row_h * max(len(rows), 1)
    longest = max((r["total_ms"] for _, r in rows), default=0) or 1
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (width, height),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="10" y="22" font-size="15">Horovod timeline: time per operation (wall %.1f ms, %d events)</text>'
        % (summary["wall_ms"], summary["events"]),
    ]
    for i, (name, r) in enumerate(rows):
        y = 40 + i * row_h
        w = max(1, int(bar_w * r["total_ms"] / longest))
        parts.append('<text x="10" y="%d">%s</text>' % (y + 15, html.escape(name[:36])))
        parts.append('<rect x="%d" y="%d" width="%d" height="%d" fill="#4878d0"/>' % (bar_x, y + 3, w, row_h - 6))
        parts.append('<text x="%d" y="%d">%.1f ms, %d x, %.0f%%</text>'
                     % (bar_x + w + 6, y + 15, r["total_ms"], r["count"], 100 * r["share_of_wall"]))
    if not rows:
        parts.append('<text x="10" y="55">No timeline events were recorded.</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


# -- commit ---------------------------------------------------------------------------------------
def commit(artifact_dir: Path, staging: Path, *, status: str, complete: bool, run_id: str,
           received: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Move what was received into ``artifact_dir`` and write the marker last.

    An incomplete transfer stays in its staging folder and the marker says ``complete: false``.
    """
    info: dict[str, Any] = {"status": status, "complete": complete, "run_id": run_id, "files": received,
                            "committed_at": time.time(), "checkpoint": None, "timeline": None}
    info.update(extra or {})
    if complete:
        timeline = staging / TIMELINE
        if timeline.exists():
            events = repair_timeline(timeline)
            summary = summarize(events)
            (staging / SUMMARY).write_text(json.dumps(summary, indent=2))
            render_svg(summary, staging / PICTURE)
            info.update(timeline=TIMELINE, timeline_summary=SUMMARY, timeline_picture=PICTURE)
        if (staging / CHECKPOINTS).is_dir() and any((staging / CHECKPOINTS).iterdir()):
            info["checkpoint"] = CHECKPOINTS
        for entry in sorted(staging.iterdir()):
            os.replace(entry, artifact_dir / entry.name)
        shutil.rmtree(staging, ignore_errors=True)
    else:
        info["staging"] = staging.name
    tmp = artifact_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, artifact_dir / MARKER)
    return info


def read_marker(artifact_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((Path(artifact_dir) / MARKER).read_text())
    return None
