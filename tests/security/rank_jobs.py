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


def torch_store_job(folder: str, wait_s: float = 120.0):
    """Every rank joins torch's process group; rank 0 writes ``MASTER_PORT`` to ``folder/port``; all
    wait until ``folder/probed`` exists (the test has attacked the store), then meet once more."""
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # written whole before the test can read it
        Path(folder, "port.tmp").write_text(os.environ["MASTER_PORT"])
        os.replace(Path(folder, "port.tmp"), Path(folder, "port"))
    deadline = time.monotonic() + wait_s
    while not Path(folder, "probed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())
