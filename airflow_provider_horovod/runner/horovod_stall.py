"""Horovod's own stall check, set for the ranks from ``stall_timeout``, and its warning read back.

Horovod's coordinator (rank 0) checks every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` for tensors that
some ranks submitted and others did not, logs which ranks are missing which tensors, and shuts
Horovod down once one has waited ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (``stall_inspector.cc``):
every waiting collective then raises ``HorovodInternalError`` and the run fails. The warning reads::

    [...: E /.../stall_inspector.cc:107] One or more tensors were submitted to be reduced, gathered
    or broadcasted by subset of ranks and are waiting for remainder of ranks for more than 2 seconds. ...
    Missing ranks:
    1!: [allreduce.grad.fc1]
    One or more rank (marked by "!") is stalled for longer than 5 seconds. Will shutdown.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

CHECK_TIME_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
SHUTDOWN_TIME_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
MAX_CHECK_S = 60  # Horovod's own default warning interval

_HEADER = re.compile(r"waiting for remainder of ranks for more than (\d+) seconds")
_MISSING = re.compile(r"^\s*(\d+)(!?): \[(.*)\]\s*$")
_SHUTDOWN = re.compile(r"stalled for longer than (\d+) seconds\. Will shutdown")


def stall_env(stall_timeout_s: int) -> dict[str, str]:
    """Horovod warns of a collective some rank has not joined after a quarter of ``stall_timeout_s``
    (at most every 60 s): its warning names the tensor. The driver's own stall rule ends the try
    after ``stall_timeout_s`` (``driver/stalls.py``), once it has every rank's stacks; Horovod's
    shutdown comes a quarter later, only where the driver cannot (ranks that cannot reach its channel)."""
    check = max(1, min(MAX_CHECK_S, stall_timeout_s // 4))
    return {CHECK_TIME_ENV: str(check), SHUTDOWN_TIME_ENV: str(stall_timeout_s + max(5, check))}


def beat_interval(stall_timeout_s: float) -> float:
    """How often a rank samples its stack and beats (``rank/stacks.py``): eight times per stall
    timeout, between 0.25 s and 1 s."""
    return min(1.0, max(0.25, stall_timeout_s / 8))


def whole_seconds(stall_timeout: float) -> int:
    """Horovod reads whole seconds: a fraction rounds up, so the timeout is never shorter than asked."""
    return max(1, math.ceil(stall_timeout))


@dataclasses.dataclass(frozen=True)
class Stall:
    """Which ranks never submitted which tensors, and how long the others waited for them."""

    missing: tuple[tuple[int, tuple[str, ...]], ...]  # (rank, tensor names), by rank
    waited_s: int
    shut_down: bool  # Horovod said "Will shutdown" (the stall timeout ended the job)

    @property
    def text(self) -> str:
        """``stalled: rank 1 never submitted allreduce.grad.fc1 (waited 60 s)``."""
        who = "; ".join("rank %d never submitted %s" % (rank, ", ".join(tensors)) for rank, tensors in self.missing)
        return "stalled: %s (waited %d s)" % (who, self.waited_s)

    def advice(self, stall_timeout_s: int) -> str:
        return ("%s. Make every rank run the same collectives (the same number of steps on every rank: "
                "runtime.dataset().steps(), or hvd.join() at the end), or raise stall_timeout (%d s) "
                "when a rank honestly waits that long." % (self.text, stall_timeout_s))


def parse_stall(lines: Iterable[str]) -> Stall | None:
    """Horovod's newest stall report in ``lines`` (a rank's output), or None when there is none.
    Every rank it lists counts, whether or not it marked it with "!" (past the timeout): ranks
    that wait for each other (one in the epoch's allreduce, one still in a gradient's) each miss
    one, and which of the two passed the timeout first is a matter of milliseconds."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if _HEADER.search(line)]
    if not starts:
        return None
    header = _HEADER.search(lines[starts[-1]])
    missing: list[tuple[int, tuple[str, ...]]] = []
    shutdown = None
    for line in lines[starts[-1] + 1:]:
        found = _MISSING.match(line)
        if found:
            missing.append((int(found.group(1)), tuple(t for t in found.group(3).removesuffix(" ...").split(", ") if t)))
            continue
        shutdown = _SHUTDOWN.search(line)
        if shutdown or "Missing ranks:" not in line:
            break
    if not missing:
        return None
    return Stall(missing=tuple(missing), waited_s=int((shutdown or header).group(1)), shut_down=shutdown is not None)


def stall_in(tails: Iterable[Iterable[str]]) -> Stall | None:
    """The first stall report in any of these ranks' outputs (only rank 0, Horovod's coordinator,
    writes one), preferring one that shut the job down."""
    found = [s for s in (parse_stall(lines) for lines in tails) if s is not None]
    return next((s for s in found if s.shut_down), found[0] if found else None)
