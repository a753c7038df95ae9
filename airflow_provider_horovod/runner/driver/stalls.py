"""The stall rule, one for every launcher: a try in which no rank makes progress for ``stall_timeout``
is a stall. Pure (time passed in), held and fed by the supervisor.

Each rank beats (``rank/stacks.py``): how long its main thread's stack has stayed the same, where it
is, and its stacks once it has stayed a while. At the verdict, every rank is one of: silent (no beat
for ``silence_s``: stopped, stuck in C, gone; the infrastructure, which restarts and retries),
stuck in the user's code (a bug: fail, no restart, no retry), waiting in a collective, or finished.
The stalled ranks are the silent and the stuck ones; when there are none, the finished ones (a rank
that ran fewer steps), else every waiting rank (collectives that do not match). What the OS says of
a silent rank comes from its task, which looks before it kills it (``RanksInspected``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from airflow_provider_horovod.runner.events import Failure, RankBeat

UNRESPONSIVE = "unresponsive"  # Failure.stall: a silent rank stalled the try (infrastructure)
STUCK = "stuck"  # Failure.stall: a rank in the user's code stalled the try (a bug)

# psutil's status words, as a user reads them
_OS_WORDS = {
    "stopped": "is stopped (SIGSTOP, a debugger or job control)",
    "tracing-stop": "is stopped by a tracer (a debugger)",
    "disk-sleep": "is in uninterruptible sleep (disk or network I/O, swapping)",
    "zombie": "has exited (a zombie its parent has not reaped)",
    "dead": "is gone",
    "gone": "is gone",
}


def silence_for(beat_s: float) -> float:
    """A rank that has not beaten for this long is silent: three beats missed, and a second for a busy host."""
    return 3 * beat_s + 1.0


@dataclasses.dataclass
class Seen:
    """The newest beat of one rank, in the driver's clock."""

    heard: float
    progressed: float
    pid: int | None = None
    host: str | None = None
    where: str = "was never heard from"
    stacks: str | None = None
    stacks_at: float | None = None
    done: bool = False


class StallWatch:
    """Who beats, who progresses, and the verdict (see the module's docstring)."""

    def __init__(self, stall_timeout_s: float, silence_s: float) -> None:
        self.timeout_s = stall_timeout_s
        self.silence_s = silence_s
        self.started: float | None = None
        self.seen: dict[int, Seen] = {}
        self.verdict_at: float | None = None
        self.states: dict[int, Mapping[str, Any]] = {}

    def start(self, now: float, ranks: int = 0) -> None:
        """The ranks were started (``ranks``: how many, when known; a rank never heard from counts from now)."""
        self.started = now
        for rank in range(ranks):
            self.seen.setdefault(rank, Seen(heard=now, progressed=now))

    def beat(self, beat: RankBeat, now: float) -> None:
        if self.verdict_at is not None:
            return  # the verdict's picture stays as it was
        old = self.seen.get(beat.rank)
        stacks = beat.stacks if beat.stacks is not None else (old.stacks if old else None)
        stacks_at = now if beat.stacks is not None else (old.stacks_at if old else None)
        self.seen[beat.rank] = Seen(heard=now, progressed=now - beat.idle_s, pid=beat.pid, host=beat.host,
                                    where=beat.where, stacks=stacks, stacks_at=stacks_at, done=beat.done)

    def inspected(self, states: Mapping[int, Mapping[str, Any]]) -> None:
        self.states.update(states)

    def due(self, now: float) -> bool:
        """No rank made progress for ``stall_timeout`` (and some rank beats: the channel works)."""
        if self.started is None or self.verdict_at is not None or not any(s.pid is not None for s in self.seen.values()):
            return False
        if all(s.done for s in self.seen.values()):
            return False
        last = max([self.started, *(s.progressed for s in self.seen.values())])
        return now - last >= self.timeout_s

    def due_in(self, now: float) -> float:
        """Seconds until ``due`` may turn true (for the supervisor's next wake-up)."""
        if self.started is None or self.verdict_at is not None:
            return float("inf")
        return max([self.started, *(s.progressed for s in self.seen.values())]) + self.timeout_s - now

    def verdict(self, now: float) -> Failure:
        """The stall, as the supervisor records it; ``failure()`` tells it again once the tasks said
        what the OS sees of the silent ranks."""
        self.verdict_at = now
        return self.failure()

    def _silent(self, rank: int) -> bool:
        s = self.seen[rank]
        return not s.done and self.verdict_at - s.heard > self.silence_s

    def _kinds(self) -> tuple[list[int], list[int], list[int], list[int]]:
        ranks = sorted(self.seen)
        silent = [r for r in ranks if self._silent(r)]
        done = [r for r in ranks if self.seen[r].done]
        waiting = [r for r in ranks if r not in silent and r not in done and self.seen[r].where.startswith("waits in")]
        stuck = [r for r in ranks if r not in silent and r not in done and r not in waiting]
        return silent, stuck, waiting, done

    def describe(self, rank: int) -> str:
        s = self.seen[rank]
        if not self._silent(rank):
            return "rank %d %s" % (rank, s.where)
        silence = self.verdict_at - s.heard
        if s.pid is None:
            return "rank %d was never heard from (%.1f s)" % (rank, silence)
        state = self.states.get(rank)
        status = str(state.get("status")) if state else None
        if status is None:
            what = "does not answer (its host did not say what its process %d does)" % s.pid
        elif status in _OS_WORDS:
            what = _OS_WORDS[status]
        else:
            what = "does not answer though its process is %s (stuck in native code that holds the GIL?)" % status
        return "rank %d %s; silent for %.1f s" % (rank, what, silence)

    def failure(self) -> Failure:
        assert self.verdict_at is not None
        silent, stuck, waiting, done = self._kinds()
        stalled = silent + stuck or done or waiting
        others = [r for r in sorted(self.seen) if r not in stalled]
        parts = [self.describe(r) for r in stalled + others]
        message = "stalled: %s (no rank made progress for %g s)" % ("; ".join(parts), self.timeout_s)
        first = stalled[0] if stalled else None
        host = self.seen[first].host if first is not None else None
        return Failure(message=message, rank=first, host=host, traceback=self.stacks_text(stalled + others),
                       stall=UNRESPONSIVE if silent else STUCK, lost=bool(silent), error_class="StallError")

    def stacks_text(self, order: list[int]) -> str:
        """Every rank's stacks, stalled ranks first (what each sent once its stack stopped moving)."""
        blocks = []
        for rank in order:
            s = self.seen[rank]
            head = "rank %d%s: %s" % (rank, " (pid %d on %s)" % (s.pid, s.host) if s.pid is not None else "",
                                      self.describe(rank).split(" ", 2)[2])
            if s.stacks and not s.done:
                age = "" if not self._silent(rank) else " (sent %.1f s before the stall)" % (self.verdict_at - s.stacks_at)
                blocks.append("%s%s\n%s" % (head, age, s.stacks))
            else:
                blocks.append("%s\n  (no stacks: %s)" % (head, "it finished" if s.done else "it did not answer"))
        return "Python stacks at the stall, by rank (> marks the user's frames):\n" + "\n".join(blocks)
