"""The driver's channel: one authenticated listener for the launch, the rank logs and the artifacts.

Barrier tasks connect first (``hello``), report their facts and get the plan, report ``ready`` and
get ``start``, report ``finished`` and get ``release``: the launch never waits on Spark's polling
``allGather``/``barrier``. Rank processes connect to stream their output (``logs``) and their
failures (``error``); rank 0's task hands over its artifacts on a connection of its own (``put``).
Every message becomes a typed event for the supervisor (``events.py``); the channel decides
nothing. Where executors cannot reach the driver (a Spark Connect session to a remote server),
clients give up quietly and the same information travels back in the barrier stage's result rows.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_horovod.runner import events, messages, names, wire
from airflow_provider_horovod.runner.transfer import TRANSFER_TIMEOUT_S, Limits, offer_tree, take_tree
from airflow_provider_horovod.runner.messages import Mode, Receipt, Received, Report, TransferError
from airflow_provider_horovod.runner.plan import Plan
from airflow_provider_horovod.runner.text import one_line

log = logging.getLogger(__name__)
rank_log = logging.getLogger("airflow_provider_horovod.ranks")


class RankOutput:
    """Where rank lines go on the driver: the ``airflow_provider_horovod.ranks`` logger at INFO when
    it shows INFO (Airflow's task log), else the driver's stdout (a notebook, a script, or a root
    logger at WARNING, as after a bare ``logging.basicConfig()``). A level set on the ranks logger or
    on ``airflow_provider_horovod`` is obeyed: that is how to silence them. Decided per batch of
    lines, so logging set up during the run counts. Control characters are escaped (``one_line``)."""

    def __init__(self, *, stream_all: bool) -> None:
        self.stream_all = stream_all

    def __call__(self, rank: int, lines: list[str], *, callback: bool) -> None:
        if not (self.stream_all or callback):
            return
        if not _logging_takes_rank_lines():
            sys.stdout.write("".join("[rank %d] %s\n" % (rank, one_line(line)) for line in lines))
            sys.stdout.flush()
        else:
            for line in lines:
                rank_log.info("[rank %d] %s", rank, one_line(line))


def _logging_takes_rank_lines() -> bool:
    """Logging is set up, and either shows the ranks logger's INFO lines or was told a level for it."""
    if not rank_log.hasHandlers():
        return False
    if rank_log.isEnabledFor(logging.INFO):
        return True
    logger: logging.Logger | None = rank_log
    while logger is not None and logger is not logging.root:
        if logger.level != logging.NOTSET:
            return True  # the user chose this package's level: lines below it are dropped on purpose
        logger = logger.parent
    return False


# What each role may say, and the most bytes of JSON each message may take: a frame's type and size
# are checked before it is parsed (``wire.FramedConnection.recv``), and no rank frame is read past
# the largest of its role's (docs/security.md, "What a rank can cost the driver").
KiB, MiB = 1024, 1024 * 1024
_RANK_SAYS = {messages.Logs: 2 * messages.LOGS_FRAME_BYTES, messages.Error: 4 * MiB, messages.Report: 128 * KiB,
              messages.Beat: 128 * KiB}
_TASK_SAYS = {messages.Logs: 16 * MiB, messages.Error: 16 * MiB, messages.Report: 128 * KiB, messages.Event: 4 * KiB,
              messages.Hello: 4 * KiB, messages.Facts: MiB, messages.Ready: 4 * KiB, messages.Finished: wire.MAX_FRAME,
              messages.PutArtifacts: 4 * KiB, messages.FetchResume: 4 * KiB, messages.PutVersion: wire.MAX_FRAME,
              messages.RankStates: 64 * KiB}
_ALLOWED = {wire.ROLE_RANK: {m.TYPE: most for m, most in _RANK_SAYS.items()},
            wire.ROLE_TASK: {m.TYPE: most for m, most in _TASK_SAYS.items()}}
MAX_EVENTS = 1024  # events recorded from the tasks per attempt (one orted-launched per task); more are dropped
MAX_CONNECTIONS_PER_RANK = 2  # a rank process opens one; more from its key are hung up on
REPORT_INTERVAL_S = 0.5  # the most often one of rank 0's reports reaches on_report (the newest waits its turn)
NO_ARTIFACTS = "this run collects no artifacts"
MAX_UNPROVEN = 256  # connections held until their knock comes (wire.Server): the oldest goes for a new one
CLOSE_WAIT_S = 3.0  # how long close() waits for a transfer to put down the chunk in hand (within the cancel's 10 s)


def _pending_per_role(role: str) -> int | None:
    """A rank (one process) has at most ``MAX_CONNECTIONS_PER_RANK`` connections in its handshake; tasks, any number."""
    return MAX_CONNECTIONS_PER_RANK if wire.rank_of(role) is not None else None


class ReportGate:
    """Rank 0's reports, at most one per ``interval`` on to ``deliver``, from a thread of the driver's
    own: a report that comes sooner waits, replaced by any newer one, so however often a rank sends,
    the driver records at most one report an interval, and the newest is never lost (``close``
    delivers it). The rank's own coalescing (``rank/reports.py``) is a courtesy, not the limit."""

    def __init__(self, deliver: Callable[[Report], None], interval: float = REPORT_INTERVAL_S) -> None:
        self._deliver = deliver
        self._interval = interval
        self._cond = threading.Condition()
        self._pending: Report | None = None
        self._next = float("-inf")
        self._closed = False
        self.coalesced = 0  # reports replaced by a newer one before their turn
        self._thread: threading.Thread | None = None

    def offer(self, report: Report) -> None:
        with self._cond:
            if self._closed:
                return
            if self._pending is not None:
                self.coalesced += 1
            self._pending = report
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hvdrunner-reports", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                wait = self._next - time.monotonic()
                if wait > 0 and not self._closed:
                    self._cond.wait(wait)
                    continue
                report, self._pending = self._pending, None
                self._next = time.monotonic() + self._interval
            try:
                self._deliver(report)
            except Exception as err:  # noqa: BLE001 - what is done with a report never breaks the run
                log.warning("Could not record rank 0's report of step %s: %s", report.step, err)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Deliver the report that waits (the last one), then take no more."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


class Channel:
    """Accepts authenticated connections, turns what they send into events, sends tasks their orders."""

    def __init__(
        self,
        secret: bytes,
        *,
        run_id: str = "",
        on_event: Callable[[events.Event], None] = lambda event: None,
        output: Callable[..., None] | None = None,
        artifact_staging: Path | None = None,
        resume_root: Path | None = None,
        limits: Limits = Limits(),
        versions: Any = None,
        on_report: Callable[[Report], None] | None = None,
        on_terminating: Callable[[str], None] | None = None,
    ) -> None:
        """``versions``: where rank 0's checkpoint versions are committed (``versions.VersionSink``);
        ``on_report``: called with rank 0's reports (``runtime.report``), at most one every
        ``REPORT_INTERVAL_S`` (the newest), from a thread of the channel's own; ``on_terminating``:
        called with the executor of a task that was told to terminate (SIGTERM: ``task/termination.py``)."""
        self._versions = versions
        self._reports = ReportGate(on_report) if on_report is not None else None
        self._rank_conns: collections.Counter[str] = collections.Counter()
        self._ranks_failed: set[int] = set()  # ranks whose failure report came: one each (issue 49)
        self._events_sent = 0  # events the tasks sent (at most MAX_EVENTS are recorded)
        self._keys = wire.server_keys(secret, wire.ROLE_TASK, ranks=True)
        self._run_id = run_id
        self._limits = limits
        self._artifacts_task_dir: str | None = None  # the one folder artifacts may be copied from
        self._resume_due: set[int] = set()  # the host leaders that have not fetched resume_from yet
        self._on_event = on_event
        self._on_terminating = on_terminating
        self._output = output or RankOutput(stream_all=True)
        self._artifact_staging = artifact_staging
        self._resume_root = resume_root
        # HVDRUNNER_ARTIFACT_TRANSPORT=stream turns the same-host copy off (tests of the stream use it).
        self._same_host_copy = os.environ.get(names.ENV_ARTIFACT_TRANSPORT, "auto") != "stream"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._transfers = 0  # transfer connections being served: close() waits for them (bounded)
        self._transfers_done = threading.Condition(self._lock)
        self._conns: set[wire.ServerConnection] = set()
        self._tasks: dict[int, wire.ServerConnection] = {}
        self._finished: set[int] = set()
        self._tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=names.TAIL_LINES))
        self._recorded: list[dict[str, Any]] = []
        self._proofs: Path | None = None
        self.address: tuple[str, int] | None = None
        self.rejected = 0
        self.unverified: list[str] = []  # why frames of keyed peers failed verification (altered on the way)
        self._refusals = wire.RefusalLog(lambda text: log.warning("Refused a connection to the driver's channel: %s", text))
        self.received: list[dict[str, Any]] = []  # the files rank 0's task handed over
        self.transport: str | None = None  # "copy" or "stream"
        self.upload_seconds: float | None = None
        self.upload_error: BaseException | None = None

    # -- life ------------------------------------------------------------------------------------
    def start(self, host: str) -> tuple[str, int] | None:
        try:
            self._listener = wire.listen(host)
        except OSError as err:
            log.info("Not listening for the barrier tasks on %s (%s); Spark's allGather coordinates them", host, err)
            return None
        self.address = (host, self._listener.getsockname()[1])
        wire.serve(self._listener, self._keys, self._serve, "hvdrunner-channel", max_unproven=MAX_UNPROVEN,
                   pending_per_role=_pending_per_role, on_reject=self._rejected)
        return self.address

    def _rejected(self, err: BaseException) -> None:
        with self._lock:
            self.rejected += 1
        self._refusals.note(err)

    def expect_plan(self, plan: Plan) -> None:
        """The plan is sent: artifacts may be copied only from rank 0's task folder in it, and only
        if that folder is named as this run's partition 0 makes its own; each host leader may
        fetch ``resume_from`` once."""
        root = plan.slots[0]
        named = os.path.basename(root.task_dir).startswith(names.TASK_DIR_PREFIX % (self._run_id, "p0", root.task_pid))
        with self._lock:
            self._artifacts_task_dir = root.task_dir if named else None
            self._resume_due = {plan.host_leader(name).partition for name, _slots in plan.hosts}

    def expect_artifacts_from(self, task_dir: str | Path) -> None:
        """Rank 0's task folder, made by this process (``np < 0``): the only folder copied from."""
        with self._lock:
            self._artifacts_task_dir = str(task_dir)

    def close(self) -> None:
        """Stop listening and hang up on every client; tasks still running take that as cancel. The
        report that waits its turn is delivered first."""
        if self._reports is not None:
            self._reports.close()
        with self._lock:  # no offer makes the folder again after this (``_proof_dir``)
            self._closed.set()
            proofs, self._proofs = self._proofs, None
        if proofs is not None:
            shutil.rmtree(proofs, ignore_errors=True)
        if self._listener is not None:
            wire.stop_listening(self._listener)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        with self._lock:  # a copy checks the cancel between chunks: let the chunk in hand land first,
            self._transfers_done.wait_for(lambda: self._transfers == 0, CLOSE_WAIT_S)  # then nothing more is written

    # -- what the driver says --------------------------------------------------------------------
    def send_tasks(self, msg: messages.Message) -> None:
        """``msg`` to every barrier task (``Planned``, ``Start``, ``Release``; ``Stop``: end your ranks now)."""
        with self._lock:
            conns = list(self._tasks.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(msg.to_json())

    # -- what the driver reads -------------------------------------------------------------------
    def tails(self) -> dict[int, list[str]]:
        with self._lock:
            return {rank: list(lines) for rank, lines in self._tails.items()}

    def recorded(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recorded)

    def record(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._recorded.append(event)

    def _record_sent(self, event: messages.Event) -> None:
        """An event a task sent: at most ``MAX_EVENTS`` of them are kept; one warning says more came."""
        with self._lock:
            self._events_sent += 1
            if self._events_sent <= MAX_EVENTS:
                self._recorded.append(event.recorded())
                return
        if self._events_sent == MAX_EVENTS + 1:
            log.warning("The barrier tasks sent more than %d events; the run's report keeps the first %d",
                        MAX_EVENTS, MAX_EVENTS)

    def lines(self, rank: int, lines: list[str], *, callback: bool = False, quiet: bool = False) -> None:
        """A rank's lines: kept for its failure report; shown unless ``quiet`` (log_callback_only)."""
        with self._lock:  # kept lines are cut where a rank's own lines are (messages.LOG_LINE_CHARS): a bounded tail
            self._tails[rank].extend(line[:messages.LOG_LINE_CHARS] for line in lines)
        if not quiet:
            self._output(rank, lines, callback=callback)

    # -- serving ---------------------------------------------------------------------------------
    def _emit(self, event: events.Event) -> None:
        if not self._closed.is_set():
            self._on_event(event)

    def _serve(self, conn: wire.ServerConnection) -> None:
        with self._lock:
            self._conns.add(conn)
        partition: int | None = None
        allowed = _ALLOWED[wire.role_family(conn.role)]
        rank = wire.rank_of(conn.role)
        conn.limit_frames(max(allowed.values()))
        try:
            if rank is not None:
                self._count_rank_connection(conn.role)
            while True:
                raw = conn.recv(allowed)
                if rank is not None:
                    raw["rank"] = rank  # a rank speaks only for itself, whatever its frames say
                msg = messages.decode(raw)
                if isinstance(msg, messages.Hello):
                    partition = msg.partition
                    with self._lock:
                        self._tasks[partition] = conn
                    self._emit(events.TaskStarted(partition, msg.executor))
                elif isinstance(msg, (messages.PutVersion, messages.PutArtifacts, messages.FetchResume)):
                    # a transfer connection: never sent orders (only tasks' own connections are)
                    conn.sock.settimeout(TRANSFER_TIMEOUT_S)
                    self._serve_transfer(conn, msg)
                elif isinstance(msg, messages.Error):
                    self._failed(msg.failure, rank)
                else:
                    self._handle(msg)
        except wire.AuthenticationError as err:
            with self._lock:
                self.unverified.append(str(err))
            self._rejected(err)
        except wire.ProtocolError as err:
            log.warning("Hung up on a %s that broke the channel's protocol: %s", conn.role, err)
        except (ConnectionError, OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                if rank is not None:
                    self._rank_conns[conn.role] -= 1
                lost = partition is not None and self._tasks.get(partition) is conn and partition not in self._finished
                if partition is not None and self._tasks.get(partition) is conn:
                    del self._tasks[partition]
            conn.close()
            if lost:
                self._emit(events.TaskLost(partition))

    def _count_rank_connection(self, role: str) -> None:
        """One more connection of ``role`` (a rank's); more than ``MAX_CONNECTIONS_PER_RANK`` at once
        is a ``ProtocolError``."""
        with self._lock:
            self._rank_conns[role] += 1
            if self._rank_conns[role] > MAX_CONNECTIONS_PER_RANK:
                raise wire.ProtocolError("%s holds more than %d connections at once" % (role, MAX_CONNECTIONS_PER_RANK))

    def _handle(self, msg: messages.Message) -> None:
        if isinstance(msg, messages.Logs):
            self.lines(msg.rank, msg.lines, callback=msg.callback, quiet=msg.quiet)
        elif isinstance(msg, messages.Facts):
            self._emit(events.FactsReported(msg.facts))
        elif isinstance(msg, messages.Ready):
            self._emit(events.TaskReady(msg.partition))
        elif isinstance(msg, messages.Finished):
            with self._lock:
                self._finished.add(msg.partition)
                for rank, lines in msg.tails.items():
                    if not self._tails.get(int(rank)):
                        self._tails[int(rank)].extend(lines)
            self._emit(events.TaskFinished(msg.partition, msg.failure))
        elif isinstance(msg, messages.Event):
            self._record_sent(msg)
            if msg.kind == "terminating" and self._on_terminating is not None:
                self._on_terminating(msg.executor or "?")
        elif isinstance(msg, Report):
            self._report(msg)
        elif isinstance(msg, messages.Beat):
            self._emit(events.RankBeat(msg.rank, msg.pid, msg.host, msg.idle_s, msg.where, msg.stacks, msg.done))
        elif isinstance(msg, messages.RankStates):
            self._emit(events.RanksInspected({int(r): s for r, s in msg.states.items() if r.isdigit() and isinstance(s, dict)}))

    def _failed(self, failure: events.Failure, rank: int | None) -> None:
        """A failure report: a task's as it says (the task reads the plan and the OS); a rank's as a
        rank may tell it (``Failure.told_by_rank``), and one per rank: a rank that sends another is
        hung up on, so its reports cannot pile up on the driver until its task is stopped."""
        if rank is not None:
            with self._lock:
                if rank in self._ranks_failed:
                    raise wire.ProtocolError("rank %d sent a second failure report; a rank fails once" % rank)
                self._ranks_failed.add(rank)
            failure = failure.told_by_rank(rank)
        self._emit(events.RankFailed(failure))

    def _report(self, report: Report) -> None:
        """Rank 0's report goes on, at most one an interval (``ReportGate``); the rank's own
        ``runtime.report`` sends no other rank's."""
        if report.rank == 0 and self._reports is not None and not self._closed.is_set():
            self._reports.offer(report)

    def _serve_transfer(self, conn: wire.ServerConnection, msg: messages.Message) -> None:
        with self._lock:
            self._transfers += 1
        try:
            self._transfer(conn, msg)
        finally:
            with self._lock:
                self._transfers -= 1
                self._transfers_done.notify_all()

    def _transfer(self, conn: wire.ServerConnection, msg: messages.Message) -> None:
        if isinstance(msg, messages.PutVersion):
            self._receive_version(conn, msg)
        elif isinstance(msg, messages.PutArtifacts):
            self._receive_artifacts(conn)
        else:
            self._send_resume(conn, msg)

    def _receive_artifacts(self, conn: wire.ServerConnection) -> None:
        """Rank 0's artifacts into the staging folder: copied here if its folder is on this host, else streamed."""
        if self._artifact_staging is None:
            conn.recv()  # the offer
            conn.send(Mode("none").to_json())
            conn.send(Receipt(False, NO_ARTIFACTS).to_json())
            return
        self._emit(events.UploadStarted())
        began = time.monotonic()
        try:
            _mode, self.received = take_tree(conn, self._artifact_staging, allow_copy=self._same_host_copy,
                                             cancelled=self._closed.is_set, chosen=self._chose,
                                             root_ok=self._may_copy_from, limits=self._limits)
            self.upload_seconds = time.monotonic() - began
        except (OSError, TransferError, wire.ProtocolError) as err:
            # the driver's disk (full, the folder went away), the task gone, or a transfer that broke the rules
            self.upload_error = err
            self._emit(events.UploadFinished(error=str(err)))
            with contextlib.suppress(OSError):
                conn.send(Receipt(False, str(err)).to_json())
            raise ConnectionError(str(err)) from err
        except BaseException:
            self._emit(events.UploadFinished(error="the transfer was cut off"))
            raise
        self._emit(events.UploadFinished())  # everything is in staging, whether or not the receipt reaches the task
        conn.send(Receipt(True, files=len(self.received)).to_json())

    def _receive_version(self, conn: wire.ServerConnection, msg: messages.PutVersion) -> None:
        """One checkpoint version from rank 0's task: its changed files, then commit (``VersionSink``)."""
        sink = self._versions
        if sink is None:
            conn.recv()  # the offer
            conn.send(Mode("none").to_json())
            conn.send(Received(0).to_json())
            conn.send(Receipt(False, NO_ARTIFACTS).to_json())
            return
        with sink.lock:
            staging = sink.fresh_staging()
            _mode, received = take_tree(conn, staging, allow_copy=self._same_host_copy, cancelled=self._closed.is_set,
                                        root_ok=self._may_copy_from, limits=self._limits)
            conn.send(Received(len(received)).to_json())
            intact = messages.Intact.from_json(conn.recv()).intact
            error = sink.commit(msg, [f["path"] for f in received]) if intact else \
                "a file changed while it was sent (rewritten in place); a newer version follows"
        conn.send(Receipt(error is None, error).to_json())

    def _chose(self, mode: str) -> None:
        self.transport = mode

    def _may_copy_from(self, root: Path) -> bool:
        """Only the ``artifacts`` (or ``outbox``) folder of rank 0's task folder, as the plan names it
        (before the plan: none)."""
        with self._lock:
            pinned = self._artifacts_task_dir
        return pinned is not None and root.name in (names.ARTIFACTS_DIR, names.OUTBOX_DIR) and \
            str(root.parent) == os.path.normpath(pinned)

    def _send_resume(self, conn: wire.ServerConnection, msg: messages.FetchResume) -> None:
        """``resume_from``, to each host leader of the plan once; anyone else is hung up on."""
        partition = msg.partition
        with self._lock:
            due = partition in self._resume_due
            self._resume_due.discard(partition)
        if not due:
            raise wire.ProtocolError("fetch-resume from partition %r, which is not a host leader of the plan that "
                                     "has not fetched it yet" % (partition,))
        proofs = self._proof_dir() if self._same_host_copy and self._resume_root is not None else None
        offer_tree(conn, self._resume_root, proofs)

    def _proof_dir(self) -> Path | None:
        """A private folder on the driver for the proof files of its own offers (``None`` once the
        channel is closed: the offer then streams). Named after this process, so a later task on this
        machine removes it if the driver dies without closing (``names.sweep_orphans``)."""
        with self._lock:
            if self._closed.is_set():
                return None
            if self._proofs is None:
                self._proofs = names.new_temp_dir(names.OFFERS_DIR_PREFIX % os.getpid())
            return self._proofs
