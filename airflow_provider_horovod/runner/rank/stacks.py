"""A rank's side of the stall rule: is this rank making progress, and where is it when it is not.

A daemon thread samples the main thread's Python stack every ``beat_s`` (``sys._current_frames``:
no signal, no ptrace, a few microseconds) and sends the driver a ``Beat``: how long the stack has
stayed the same (``runtime.report()`` and a torch optimizer's ``step()`` count as a change), and, once it has stayed the same for half
of ``stall_timeout``, every thread's stack with the user's frames first. A rank that stops beating
(stopped by the OS, stuck in C code that holds the GIL, gone) is one the driver names as silent; the
driver's supervisor decides what is a stall (``driver/stalls.py``).

What counts as progress was chosen by measurement (docs/runtime.md, "Stalls"): a training step moves
the main thread through Python frames many times a second under every launcher, while a rank waiting
in a collective (Horovod's ``synchronize``, torch's ``work.wait()``) or sleeping keeps one stack and
still beats (both release the GIL).
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from types import FrameType

from airflow_provider_horovod.runner.messages import Beat
from airflow_provider_horovod.runner.horovod_stall import beat_interval

MAX_STACKS_CHARS = 32 * 1024  # one rank's stacks in a beat (a deep recursion is cut, its ends kept)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_LIBRARY_DIRS = tuple(sorted({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                             | {_PACKAGE_DIR}))
# where a rank waits for its peers: the frameworks' collectives (Horovod's, torch.distributed's, DDP's;
# DDP allreduces the gradients inside autograd's backward, so a DDP rank waits there)
_COLLECTIVE_PARTS = (os.sep + "horovod" + os.sep, os.sep.join(("", "torch", "distributed", "")),
                     os.sep.join(("", "torch", "nn", "parallel", "")), os.sep.join(("", "torch", "autograd", "")))


def is_user_file(filename: str) -> bool:
    """A frame of the user's code: not Python's, an installed package's or this provider's."""
    return not filename.startswith("<") and not filename.startswith(_LIBRARY_DIRS)


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Outermost first, as a traceback reads."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out[::-1]


def fingerprint(frame: FrameType | None) -> tuple:
    """What changes when the thread moves: each frame's code and line."""
    return tuple((id(f.f_code), f.f_lineno) for f in _frames(frame))


def place_of(frame: FrameType | None) -> str:
    """One line: ``waits in allreduce (called at train, jobs.py:40)`` or ``in user code at sleepy (jobs.py:52)``."""
    frames = _frames(frame)
    users = [i for i, f in enumerate(frames) if is_user_file(f.f_code.co_filename)]
    at = ""
    if users:
        f = frames[users[-1]]
        at = "%s (%s:%d)" % (f.f_code.co_name, os.path.basename(f.f_code.co_filename), f.f_lineno)
    below = frames[users[-1] + 1:] if users else frames
    collective = next((f.f_code.co_name for f in below if any(p in f.f_code.co_filename for p in _COLLECTIVE_PARTS)
                       and not f.f_code.co_name.startswith("_") and f.f_code.co_name != "wrapper"), None)
    if collective is not None:
        return "waits in %s%s" % (collective, " (called at %s)" % at if at else "")
    if at:
        return "in user code at %s" % at
    return "in %s (%s:%d)" % (frames[-1].f_code.co_name, os.path.basename(frames[-1].f_code.co_filename),
                              frames[-1].f_lineno) if frames else "in no Python frame"


def _thread_text(name: str, frame: FrameType) -> str:
    frames = _frames(frame)
    users = [i for i, f in enumerate(frames) if is_user_file(f.f_code.co_filename)]
    skipped = users[0] if users else 0  # the runner's frames above the user's first are not the story
    lines = ["  Thread %s:" % name]
    if skipped:
        lines.append("    (%d frames of the runner above)" % skipped)
    for f, summary in zip(frames[skipped:], traceback.extract_stack(frame)[skipped:]):
        mark = ">" if is_user_file(f.f_code.co_filename) else " "
        lines.append("  %s File \"%s\", line %s, in %s" % (mark, summary.filename, summary.lineno, summary.name))
        if summary.line:
            lines.append("        %s" % summary.line.strip())
    return "\n".join(lines)


def _runners(frame: FrameType) -> bool:
    """A thread of this provider's own (the channel, the output pump, the watchdog): no user frame, one of ours."""
    frames = _frames(frame)
    return not any(is_user_file(f.f_code.co_filename) for f in frames) and \
        any(f.f_code.co_filename.startswith(_PACKAGE_DIR) for f in frames)


def stacks_text() -> str:
    """Every thread's stack: the main thread (the training function) first, then threads with the
    user's frames, then the rest; the runner's own threads last, one line each. ``>`` marks the
    user's frames."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident

    def order(ident: int) -> tuple:
        frame = frames[ident]
        user = any(is_user_file(f.f_code.co_filename) for f in _frames(frame))
        return (ident != main, not user, _runners(frame), names.get(ident, ""))

    def text_of(ident: int) -> str:
        name, frame = names.get(ident, str(ident)), frames[ident]
        if ident != main and _runners(frame):
            ours = [f for f in _frames(frame) if f.f_code.co_filename.startswith(_PACKAGE_DIR)][-1]
            return "  Thread %s: the runner's (%s, %s:%d)" % (name, ours.f_code.co_name,
                                                            os.path.basename(ours.f_code.co_filename), ours.f_lineno)
        return _thread_text(name, frame)

    me = threading.get_ident()
    text = "\n".join(text_of(ident) for ident in sorted(frames, key=order) if ident != me or ident == main)
    if len(text) > MAX_STACKS_CHARS:
        half = MAX_STACKS_CHARS // 2
        text = text[:half] + "\n    ... (%d characters cut) ...\n" % (len(text) - 2 * half) + text[-half:]
    return text


class Watch:
    """The sampling thread (see the module's docstring). ``progress()``: ``runtime.report`` was called."""

    def __init__(self, client, stall_timeout_s: float, beat_s: float | None = None) -> None:
        self._client = client
        self.stall_timeout_s = stall_timeout_s
        self.beat_s = beat_s or beat_interval(stall_timeout_s)
        self._reports = 0
        self._seen_reports = 0
        self._print: tuple = ()
        self._since = time.monotonic()
        self._sent_stacks = False
        self.longest_idle_s = 0.0
        self.busy_s = 0.0
        self._hooked = False
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._host = socket.gethostname()
        self._thread = threading.Thread(target=self._loop, name="hvdrunner-stall-watch", daemon=True)
        self._thread.start()

    def progress(self, *_: object) -> None:
        self._reports += 1  # one add: runtime.report() and an optimizer step cost training nothing more

    def _hook_optimizers(self) -> None:
        """Once torch's optimizers are imported: every ``optimizer.step()`` of any torch optimizer
        (DDP's, FSDP's, accelerate's, Horovod's DistributedOptimizer) is progress. Sampling alone can
        alias: a loop whose main thread releases the GIL at one place (``backward()``, a CUDA sync)
        is sampled there again and again, one stack however many steps pass."""
        if self._hooked or "torch.optim.optimizer" not in sys.modules:
            return
        self._hooked = True
        register = getattr(sys.modules["torch.optim.optimizer"], "register_optimizer_step_post_hook", None)
        if register is not None:
            register(self.progress)

    def sample(self, now: float) -> Beat:
        """This moment's beat (the thread calls it every ``beat_s``)."""
        self._hook_optimizers()
        frame = sys._current_frames().get(self._main)
        printed = fingerprint(frame)
        if printed != self._print or self._reports != self._seen_reports:
            self._print, self._seen_reports, self._since, self._sent_stacks = printed, self._reports, now, False
        idle = now - self._since
        self.longest_idle_s = max(self.longest_idle_s, idle)  # what a healthy run shows (benchmarks/throughput.py)
        stacks = None
        if idle >= self.stall_timeout_s / 2 and not self._sent_stacks:
            stacks, self._sent_stacks = stacks_text(), True  # the same stack until it moves: sent once
        return Beat(pid=os.getpid(), host=self._host, idle_s=round(idle, 3), where=place_of(frame), stacks=stacks)

    def _loop(self) -> None:
        # The first beat at once: a rank that stops (SIGSTOP) or blocks in native code before its first
        # interval ended is still named by its pid and its host's word for it, not "never heard from"
        # (a forked rank reaches its training in milliseconds: rank/warm.py).
        first = True
        while first or not self._done.wait(self.beat_s):
            first = False
            began = time.perf_counter()
            try:
                self._client.send(self.sample(time.monotonic()))
            except Exception:  # noqa: BLE001 - the watch never breaks the rank it watches
                pass
            self.busy_s += time.perf_counter() - began  # what it took from training, at most (benchmarks)

    def close(self) -> None:
        """The training function returned: a last beat says so (a finished rank is not a silent one)."""
        self._done.set()
        self._client.send(Beat(pid=os.getpid(), host=self._host, idle_s=0.0, where="finished its training function",
                               done=True))
