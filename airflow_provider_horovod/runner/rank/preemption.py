"""The preemption notice on the rank side: a flag file in the barrier task's folder.

The driver tells every barrier task when Spark decommissions an executor of the attempt
(``driver/preemption.py``); each task writes ``preempting`` into its folder
(``task/termination.announce``), which every rank of that task sees at once: ``runtime.preempting()`` is a ``stat``, cheap enough for every
step, and ``runtime.on_preemption(callback)`` runs ``callback`` once, from a thread of the rank.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from airflow_provider_horovod.runner import names

POLL_S = 0.1


def preempting() -> bool:
    """Whether this rank's task was told that the attempt is about to lose an executor; ``False``
    outside a rank."""
    base = os.environ.get(names.ENV_TASK_DIR)
    return base is not None and names.TaskDir(base).preempting.exists()


def check_callback(callback: object) -> None:
    """``callback`` is something ``on_preemption`` can call with no arguments; else a ``TypeError`` naming the fix."""
    if not callable(callback):
        raise TypeError(
            "runtime.on_preemption() needs a function to call with no arguments when the notice comes; got %r (a %s). "
            "Pass the function itself: runtime.on_preemption(save), not runtime.on_preemption(\"save\") or "
            "runtime.on_preemption(save())." % (callback, type(callback).__name__))
    try:
        inspect.signature(callback).bind()
    except TypeError as err:
        raise TypeError("runtime.on_preemption(%s): the callback is called with no arguments, but %s. Wrap it: "
                        "runtime.on_preemption(lambda: %s(...))."
                        % (getattr(callback, "__name__", repr(callback)), err, getattr(callback, "__name__", "f"))) from None
    except ValueError:  # a builtin without a signature: it is called as it is
        pass


def on_preemption(callback: Callable[[], None], stop: threading.Event | None = None) -> threading.Thread:
    """Call ``callback()`` once, from a daemon thread, when ``preempting()`` turns true (at once if
    it is already). ``stop`` ends the watch without a call. A ``callback`` that is not callable (a
    name, ``on_preemption(save())``'s result) is a ``TypeError`` now, not when a notice comes."""
    check_callback(callback)
    stop = stop or threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if preempting():
                callback()
                return
            stop.wait(POLL_S)

    thread = threading.Thread(target=watch, name="hvdrunner-preemption", daemon=True)
    thread.start()
    return thread
