"""The stall rule (``driver/stalls.py``) as the supervisor applies it, fed beats and made-up times,
and the rank's side of it (``rank/stacks.py``) on this process's own threads."""

from __future__ import annotations

import threading
import time

from airflow_provider_horovod.runner.driver.supervisor import Deadlines, Stop
from airflow_provider_horovod.runner.driver.restarts import Ending, ending_of
from airflow_provider_horovod.runner.events import RankBeat, RanksInspected
from airflow_provider_horovod.runner.rank import stacks
from tests.unit.runner.driver.test_supervisor import launched

STALL_S = 600.0  # the supervisor of test_supervisor.launched() has the default stall timeout


def beat(rank: int, idle_s: float, where: str = "waits in allreduce (called at train (job.py:9))", **kw) -> RankBeat:
    return RankBeat(rank=rank, pid=100 + rank, host="hvdhost%d" % rank, idle_s=idle_s, where=where, **kw)


def test_a_rank_that_keeps_moving_keeps_the_try_alive_however_long_the_others_wait():
    sup = launched()
    for t in range(1, 1300, 100):
        sup.handle(beat(0, idle_s=float(t)), float(t))
        sup.handle(beat(1, idle_s=0.0, where="in user code at train (job.py:12)"), float(t))
        assert sup.tick(float(t)) == []
    assert sup.stalls.verdict_at is None


def test_no_progress_for_the_stall_timeout_stops_the_try_naming_the_rank_stuck_in_user_code_with_its_stacks():
    sup = launched()
    sup.handle(beat(0, idle_s=0.0), 10.0)
    sup.handle(beat(1, idle_s=0.0, where="in user code at sleepy (job.py:52)"), 10.0)
    sup.handle(beat(1, idle_s=300.0, where="in user code at sleepy (job.py:52)", stacks="  Thread MainThread: ..."), 310.0)
    assert sup.tick(600.0) == []
    for t in (605.0, 609.0):
        sup.handle(beat(0, idle_s=t - 10.0), t)
        sup.handle(beat(1, idle_s=t - 10.0, where="in user code at sleepy (job.py:52)"), t)
    assert sup.tick(609.0) == []
    assert sup.tick(610.0) == [Stop()]
    failure = sup.cause
    assert failure.message == ("stalled: rank 1 in user code at sleepy (job.py:52); rank 0 waits in allreduce "
                               "(called at train (job.py:9)) (no rank made progress for 600 s)")
    assert (failure.rank, failure.host, failure.stall, failure.lost) == (1, "hvdhost0", "stuck", False)  # the plan's host
    assert failure.traceback.startswith("Python stacks at the stall")
    assert "rank 1 (pid 101 on hvdhost1): in user code at sleepy (job.py:52)\n  Thread MainThread: ..." in failure.traceback
    assert ending_of(cancelled=False, reason=sup.reason, cause=sup.cause, job_error=None) == Ending.FAILED  # no restart


def test_a_silent_rank_is_unresponsive_and_named_with_what_its_task_saw_of_its_process():
    sup = launched()
    sup.handle(beat(0, idle_s=0.0), 10.0)
    sup.handle(beat(1, idle_s=0.0, where="in user code at train (job.py:12)"), 10.0)
    for t in range(20, 611, 10):
        sup.handle(beat(0, idle_s=t - 10.0), float(t))
    assert sup.tick(610.0) == [Stop()]
    assert sup.cause.message.startswith("stalled: rank 1 does not answer (its host did not say what its process 101 "
                                        "does); silent for 600.0 s; rank 0 waits in allreduce")
    assert (sup.cause.stall, sup.cause.lost) == ("unresponsive", True)
    assert ending_of(cancelled=False, reason=sup.reason, cause=sup.cause, job_error=None) == Ending.LOST  # restarts
    sup.handle(RanksInspected({1: {"pid": 101, "status": "stopped"}}), 611.0)
    told = sup.stalls.failure()
    assert told.message.startswith("stalled: rank 1 is stopped (SIGSTOP, a debugger or job control); silent for 600.0 s;")
    assert "rank 1 (pid 101 on hvdhost1): is stopped" in told.traceback and "(no stacks: it did not answer)" in told.traceback


def test_a_rank_that_finished_early_is_the_stalled_one_and_a_try_whose_ranks_all_finished_never_stalls():
    sup = launched()
    sup.handle(beat(1, idle_s=0.0, where="finished its training function", done=True), 5.0)
    for t in range(5, 607, 10):
        sup.handle(beat(0, idle_s=t - 5.0), float(t))
    assert sup.tick(606.0) == [Stop()]
    assert sup.cause.message.startswith("stalled: rank 1 finished its training function; rank 0 waits in allreduce")
    done = launched()
    for rank in (0, 1):
        done.handle(beat(rank, idle_s=0.0, where="finished its training function", done=True), 5.0)
    assert done.tick(10_000.0) == [] and done.stalls.verdict_at is None


def test_no_beat_at_all_is_no_stall_the_ranks_could_not_reach_the_channel():
    sup = launched()
    assert sup.tick(10_000.0) == []


def test_the_deadline_is_the_users_stall_timeout():
    assert Deadlines(stall_s=4.0).stall_s == 4.0
    sup = launched()
    assert sup.stalls.timeout_s == STALL_S


def test_a_rank_sees_a_sleeping_thread_in_the_users_code_and_its_stack_stays_the_same():
    release = threading.Event()

    def sleepy_user_function():
        release.wait(30)  # this test file is the user's code here

    thread = threading.Thread(target=sleepy_user_function, name="trainer")
    thread.start()
    try:
        time.sleep(0.05)
        frame = __import__("sys")._current_frames()[thread.ident]
        assert stacks.place_of(frame).startswith("in user code at sleepy_user_function (test_stalls.py:")
        first = stacks.fingerprint(frame)
        time.sleep(0.05)
        assert stacks.fingerprint(__import__("sys")._current_frames()[thread.ident]) == first
        text = stacks.stacks_text()
        assert "Thread trainer:" in text and "> File" in text and "in sleepy_user_function" in text
    finally:
        release.set()
        thread.join()


def test_the_watch_sends_its_stacks_once_the_stack_stood_still_for_half_the_stall_timeout():
    sent = []

    class Client:
        def send(self, msg):
            sent.append(msg)

    watch = stacks.Watch(Client(), stall_timeout_s=3600.0)  # its own thread beats once an hour: not in this test
    try:
        now, beats = time.monotonic(), []
        for later in (0, 1000, 3000, 3001):  # sampled from one line: this (main) thread's stack stands still
            if later == 1000:
                watch.progress()  # runtime.report() is progress
            beats.append(watch.sample(now + later))
        assert beats[0].stacks is None and beats[1].idle_s == 0.0
        assert beats[2].idle_s == 2000.0 and "Thread MainThread:" in beats[2].stacks
        assert beats[3].stacks is None  # sent once while it stands still
    finally:
        watch.close()
    assert sent[-1].done


def test_an_optimizer_step_is_progress_though_the_sampled_stack_stays_the_same():
    import torch

    sent = []

    class Client:
        def send(self, msg):
            sent.append(msg)

    watch = stacks.Watch(Client(), stall_timeout_s=3600.0)
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        now, beats = time.monotonic(), []
        for later in (0, 1000, 2000):  # sampled from one line, as a loop sampled in backward() every time
            if later == 2000:
                optimizer.step()
            beats.append(watch.sample(now + later))
        assert beats[1].idle_s == 1000.0 and beats[2].idle_s == 0.0
    finally:
        watch.close()
