"""Child processes: argv lists only, a session of their own, killed whole, and the reaper that dies with its task."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from airflow_provider_horovod.runner import procs

SLEEPER = [sys.executable, "-c", "import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]


def _children_of(pid: int, n: int, timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = psutil.Process(pid).children(recursive=True)
        if len(kids) >= n:
            return kids
        time.sleep(0.05)
    raise AssertionError("the child never started its own child")


def test_a_command_given_as_one_string_is_refused():
    with pytest.raises(TypeError, match="argv must be a list"):
        procs.spawn("sleep 1", {})


def test_kill_tree_takes_down_the_childs_own_children_and_remembers_it_did():
    proc = procs.spawn(SLEEPER, {}, stdin=subprocess.DEVNULL)
    grandchild = _children_of(proc.pid, 1)[0]
    assert os.getpgid(proc.pid) == proc.pid  # the leader of a group (and session) of its own
    procs.kill_tree(proc, grace_s=1.0)
    assert proc.poll() is not None and not procs.alive(grandchild.pid)
    assert procs.killed_by_us(proc.pid)


def test_a_stopped_process_is_killed_at_once_not_waited_for():
    proc = procs.spawn(SLEEPER, {}, stdin=subprocess.DEVNULL)
    grandchild = _children_of(proc.pid, 1)[0]
    os.kill(grandchild.pid, signal.SIGSTOP)  # a SIGSTOPped rank: SIGTERM stays pending for ever
    began = time.monotonic()
    procs.kill_tree(proc, grace_s=5.0)
    assert not procs.alive(grandchild.pid) and proc.poll() is not None
    assert time.monotonic() - began < 4.0  # the grace is not spent waiting for it


def test_the_reaper_ends_its_command_when_the_watched_process_dies():
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reaper = procs.spawn(procs.reaped(SLEEPER, watched.pid), {}, stdin=subprocess.DEVNULL)
    command = _children_of(reaper.pid, 2)[0]  # the reaper's command and that command's own child
    watched.kill()
    watched.wait()
    assert reaper.wait(timeout=15) == 143  # a watchdog tick (0.5 s) and a kill later
    assert not procs.alive(command.pid)


def test_kill_all_stops_every_tree_this_process_started():
    started = [procs.spawn(SLEEPER, {}, stdin=subprocess.DEVNULL) for _ in range(2)]
    procs.kill_all(grace_s=1.0)
    assert [p.poll() is not None for p in started] == [True, True]


def test_the_reaper_ends_when_a_second_sigterm_comes_while_it_is_finishing():
    """Airflow's SIGTERM reached the reaper, which is taking its command's session down (a command
    that ignores SIGTERM keeps it in kill_tree's 1 s grace) when a second SIGTERM comes (the
    process group's kill, then the task's): the handler runs on the thread that is finishing, and
    must finish, not wait for itself (a reaper and a zombie orted were left so in one CI run)."""
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('ready', flush=True); time.sleep(60)"]
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reaper = procs.spawn(procs.reaped(stubborn, watched.pid), {}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert reaper.stdout.readline() == b"ready\n"
        (command,) = psutil.Process(reaper.pid).children()
        reaper.send_signal(signal.SIGTERM)
        time.sleep(0.4)  # inside kill_tree's grace: the command ignored its SIGTERM
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(timeout=15) == 143
        assert not procs.alive(command.pid)
    finally:
        watched.kill()
        watched.wait()


FAKE_TASK = """
import os, subprocess, sys, tempfile, time
from airflow_provider_horovod.runner import names, procs
root = sys.argv[1]
task = names.TaskDir(tempfile.mkdtemp(prefix=names.TASK_DIR_PREFIX % ("abc123", "p0", os.getpid()), dir=root))
task.payload.write_bytes(b"payload")
task.exec_key.write_text("key")
janitor = procs.start_janitor(root)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                        env=dict(os.environ, **{names.ENV_PLAN: str(task.plan)}))  # no watchdog of its own
print(janitor.pid, rank.pid, flush=True)
time.sleep(60)
"""


def test_the_janitor_removes_a_killed_tasks_folder_and_ends_its_processes_at_once(tmp_path):
    # Spark ends a cancelled task's Python worker with SIGKILL: no finally of the task runs
    other = tmp_path / ((procs.names.TASK_DIR_PREFIX % ("abc123", "p1", os.getpid())) + "x")  # a live task's
    other.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env=dict(os.environ, **{procs.names.ENV_PLAN: str(other / "plan.json")}))
    task = subprocess.Popen([sys.executable, "-c", FAKE_TASK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    rank = None
    try:
        janitor, rank = (int(w) for w in task.stdout.readline().split())
        folder = next(p for p in tmp_path.iterdir() if p != other)
        assert (folder / "exec.key").exists() and (folder / "payload.pkl").exists()
        time.sleep(0.3)  # the janitor is up and watching
        task.kill()
        task.wait()
        killed = time.monotonic()
        while (folder.exists() or procs.alive(rank) or procs.alive(janitor)) and time.monotonic() - killed < 3:
            time.sleep(0.02)  # at once: a pidfd, no watchdog tick; then one SIGTERM
        assert not folder.exists() and not procs.alive(rank) and not procs.alive(janitor)
        assert other.exists() and bystander.poll() is None  # another task's folder and processes stay
    finally:
        for proc in (task, bystander):
            proc.kill()
            proc.wait()
        with contextlib.suppress(psutil.Error, TypeError):
            psutil.Process(rank).kill()
