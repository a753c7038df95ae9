"""A barrier task told to terminate (SIGTERM, ``task/termination.py``): the notice at once, to its own
ranks (the flag file) and to the driver (a ``terminating`` event); ``grace_s`` later the reason (a
failure killed by SIGTERM: lost infrastructure) and the end of its ranks and of itself.

Each case runs the task's side in a process of its own, as a barrier task runs in Spark's Python
worker: its main thread waits for a "rank" (a ``procs.spawn`` child) and then cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

TASK = r"""
import json, os, signal, sys, time
from pathlib import Path
from airflow_provider_horovod.runner import procs
from airflow_provider_horovod.runner.task.termination import SigtermNotice

class Client:  # what the driver would hear, one line each
    def send(self, msg):
        print(json.dumps(msg.to_json()), flush=True)

task_dir, grace, rank_s, linger = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
notice = SigtermNotice(Client(), task_dir, 1, "10.0.0.2:7078", grace)
rank = procs.spawn(["sleep", rank_s], dict(os.environ))
print(json.dumps({"rank": rank.pid}), flush=True)
rank.wait()
notice.close()
print(json.dumps({"closed": True, "default_handler": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}), flush=True)
time.sleep(linger)  # a Spark Python worker lives on after its task
"""


def _task(tmp_path, grace: float, rank_s: float, linger: float = 0.0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", TASK, str(tmp_path), str(grace), str(rank_s), str(linger)],
                            stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())["rank"]


def _said(proc: subprocess.Popen) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.read().splitlines()]


def test_sigterm_tells_the_ranks_and_the_driver_at_once_and_ends_the_task_after_the_grace(tmp_path):
    proc, rank = _task(tmp_path, grace=1.0, rank_s=600, linger=30)
    proc.send_signal(signal.SIGTERM)
    first = json.loads(proc.stdout.readline())
    assert first == {"t": "event", "kind": "terminating", "partition": 1, "executor": "10.0.0.2:7078", "rank": None}
    assert (tmp_path / "preempting").exists()  # runtime.preempting() in the task's ranks
    sent = time.monotonic()
    assert proc.poll() is None and psutil.pid_exists(rank)  # the ranks go on, to commit a version
    assert proc.wait(timeout=10) == -signal.SIGTERM  # ended as it was asked
    took = time.monotonic() - sent
    said = _said(proc)
    assert said[0]["t"] == "error" and said[0]["exit"] == "was killed by SIGTERM"  # lost infrastructure: restarts
    assert "told to terminate (SIGTERM)" in said[0]["message"] and said[0]["executor"] == "10.0.0.2:7078"
    assert 0.8 < took < 3.0  # the grace, then at once: its rank ended and it cleaned up
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


def test_a_second_sigterm_ends_the_task_at_once(tmp_path):
    proc, rank = _task(tmp_path, grace=60.0, rank_s=600)
    proc.send_signal(signal.SIGTERM)
    assert json.loads(proc.stdout.readline())["kind"] == "terminating"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == -signal.SIGTERM
    os.kill(rank, signal.SIGKILL)  # its reaper's work in a real task (procs.reaped)


def test_a_task_whose_ranks_end_within_the_grace_returns_as_usual(tmp_path):
    proc, _ = _task(tmp_path, grace=60.0, rank_s=1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    said = _said(proc)
    assert [m.get("kind") or m.get("t") or "closed" for m in said] == ["terminating", "closed"]
    assert said[-1]["default_handler"] is True


def test_without_sigterm_nothing_is_sent_and_the_handler_is_put_back(tmp_path):
    proc, _ = _task(tmp_path, grace=60.0, rank_s=0.2)
    assert proc.wait(timeout=10) == 0
    assert _said(proc) == [{"closed": True, "default_handler": True}]
    assert not (tmp_path / "preempting").exists()


def test_a_task_the_driver_already_stopped_ends_at_sigterm_at_once(tmp_path):
    """Spark without its Python daemon kills a cancelled task's worker by SIGTERM: no notice then."""
    stopped = TASK.replace("class Client:  # what the driver would hear, one line each",
                           "import threading\nclass Client:  # what the driver would hear, one line each\n"
                           "    stopped = threading.Event()\n    stopped.set()")
    proc = subprocess.Popen([sys.executable, "-c", stopped, str(tmp_path), "60", "600", "0"], stdout=subprocess.PIPE,
                            text=True)
    rank = json.loads(proc.stdout.readline())["rank"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == -signal.SIGTERM
    os.kill(rank, signal.SIGKILL)  # its reaper's work in a real task (it holds the output pipe open)
    assert _said(proc) == [] and not (tmp_path / "preempting").exists()
