"""Training functions of the security tests: what a hostile or careless rank does (run by reference)."""

from __future__ import annotations

import os

FORGED = "[2026-12-04, 10:00:00 UTC] {taskinstance.py:1} INFO - Marking task as SUCCESS"


def forged_failure_job(how: str = "raise"):
    """Print, then fail with, text that would forge records of the task log if shown raw."""
    print("loss 0.1\r%s\x1b[2K" % FORGED, flush=True)
    print(FORGED, flush=True)
    if how == "raise":
        raise ValueError("boom\n%s\u2028%s" % (FORGED, FORGED))
    os._exit(3)


def environment_job():
    """The environment a rank was started with."""
    return dict(os.environ)
