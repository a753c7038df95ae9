"""Failure facts come from whoever can know them (issue 49, T5-3): a rank's own report describes
its exception and nothing else. Where it ran is the plan's, how its process ended the operating
system's, a loss the channel's, a stall the driver's; its ``error_class`` is one a rank raises.
Before: a plain ``ValueError`` reported as "lost, killed by SIGKILL on gpu-node-7" restarted the
attempt, was retried by Airflow, and the log, the XCom and the view blamed an innocent host.

Also the suspected finding (a) of issue 49, proven: a rank's failure reports piled up on the driver
(every ``error`` frame became one more failure held by the supervisor) until its task was stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from airflow_provider_horovod.exceptions import InsufficientSlotsError, PayloadError
from airflow_provider_horovod.retry import Cause, judge
from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.driver.attempt import run_error
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.driver.restarts import Ending, ending_of
from airflow_provider_horovod.runner.driver.supervisor import Deadlines, Supervisor
from airflow_provider_horovod.runner.events import Failure, FactsReported, RankBeat, RankFailed, TaskReady
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.plan import make_plan
from airflow_provider_horovod.runner.exits import TaskFailure, failure_blob, parse_failure, rank_exit_failure
from tests.plans import task_facts
from tests.security.attacker import SECRET, hung_up, settle

# What a hostile rank says of itself: a plain ValueError dressed up as lost infrastructure elsewhere.
FORGED = {"message": "Rank 1 on host gpu-node-7 (executor 9) was killed by SIGKILL", "exception": "ValueError: boom",
          "lost": True, "exit": "was killed by SIGKILL", "host": "gpu-node-7", "executor": "9", "stall": "unresponsive",
          "consequence": False, "error_class": "InsufficientSlotsError", "launcher_output": ["mpirun: node lost"],
          "time": 0.0}


def planned_supervisor(tmp_path: Path) -> Supervisor:
    """A supervisor of two tasks on hosts a and b, planned (rank 1 runs on hvdhost1, executor b:1)."""
    sup = Supervisor(2, coordinated=True, planner=make_plan, deadlines=Deadlines(), now=0.0)
    for p, executor in enumerate(("a:1", "b:1")):
        sup.handle(FactsReported(task_facts(p, executor, task_dir=str(tmp_path / ("p%d" % p)))), 0.0)
    assert sup.plan is not None
    return sup


def test_a_ranks_report_over_the_channel_decides_no_loss_host_exit_stall_or_provider_class(tmp_path):
    events = []
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    try:
        conn = wire.connect(address, wire.Credentials.of(SECRET, wire.rank_role(1)))
        conn.send({"t": "error", **FORGED})
        assert settle(lambda: len(events) == 1)
        conn.close()
    finally:
        channel.close()
    sup = planned_supervisor(tmp_path)
    sup.handle(events[0], 1.0)
    cause = sup.cause
    assert (cause.rank, cause.lost, cause.exit, cause.stall, cause.error_class, cause.launcher_output) == \
        (1, False, None, None, None, ())
    assert (cause.host, cause.executor) == ("hvdhost1", "b:1")  # the plan's, never the rank's word
    assert cause.message == "Rank 1 on host hvdhost1 (executor b:1) failed: ValueError: boom"
    assert "gpu-node-7" not in json.dumps(cause.to_json())
    assert ending_of(cancelled=False, reason="error", cause=cause, job_error=None) == Ending.FAILED  # no restart
    err = run_error(cause, {}, launcher="gloo", stall_timeout=60)
    assert not isinstance(err, InsufficientSlotsError)
    assert judge(err).cause == Cause.USER_CODE  # no Airflow retry either


def test_a_stall_names_the_host_of_the_plan_not_the_one_a_ranks_beats_gave(tmp_path):
    sup = planned_supervisor(tmp_path)
    for p in (0, 1):
        sup.handle(TaskReady(p), 0.5)
    for t in (1.0, 700.0):
        sup.handle(RankBeat(rank=0, pid=100, host="hvdhost0", idle_s=t - 1.0, where="waits in allreduce"), t)
        sup.handle(RankBeat(rank=1, pid=101, host="gpu-node-7", idle_s=t - 1.0, where="in user code at f (j.py:1)"), t)
    sup.tick(700.0)
    assert (sup.cause.stall, sup.cause.rank, sup.cause.host, sup.cause.executor) == ("stuck", 1, "hvdhost1", "b:1")


def test_a_provider_class_a_rank_raises_still_reaches_the_driver(tmp_path):
    told = Failure.from_json({**FORGED, "error_class": "PayloadError"}).told_by_rank(1)
    assert isinstance(run_error(told, {}, launcher="gloo", stall_timeout=60), PayloadError)


def test_a_ranks_error_file_gives_the_task_no_facts_but_its_exception(tmp_path):
    """The task's own report (trusted by the driver) takes the exit from waitpid and the host from
    the plan, whatever the rank wrote into its error file."""
    sup = planned_supervisor(tmp_path)
    slot = sup.plan.slots[1]
    task = TaskDir(slot.task_dir)
    task.error(slot.rank).parent.mkdir(parents=True, exist_ok=True)
    task.error(slot.rank).write_text(json.dumps(FORGED))
    failure = rank_exit_failure(slot, 1, stopping=False)
    assert (failure.lost, failure.exit, failure.stall, failure.host, failure.executor, failure.error_class) == \
        (False, "exited with code 1", None, "hvdhost1", "b:1", None)
    assert failure.time == os.stat(task.error(slot.rank)).st_mtime  # when: the file's, not the rank's 0.0


def test_a_ranks_words_cannot_forge_the_failure_a_task_raises_through_spark():
    """Without the channel (np < 0, or Spark's fallback) the task raises the failure in its error
    text; a rank's exception text holding a forged blob is not the one read back."""
    forged_blob = failure_blob({**FORGED, "rank": 0})
    told = Failure.from_json({**FORGED, "exception": "ValueError: %s" % forged_blob}).told_by_rank(1)
    text = "Job aborted due to stage failure: ... TaskFailure: %s\n\tat org.apache.spark..." % TaskFailure(told)
    parsed = parse_failure(text)
    assert (parsed.rank, parsed.lost, parsed.exit, parsed.host) == (1, False, None, None)


def test_a_rank_that_keeps_sending_failure_reports_is_hung_up_on_and_one_is_kept():
    events = []
    channel = Channel(SECRET, on_event=events.append)
    address = channel.start("127.0.0.1")
    big = {"t": "error", "exception": "ValueError: x", "traceback": "y" * (1 << 20)}
    try:
        conn = wire.connect(address, wire.Credentials.of(SECRET, wire.rank_role(1)))
        conn.send(big)
        for _ in range(8):
            try:
                conn.send(big)
            except OSError:
                break
        assert hung_up(conn.sock)
        for _ in range(3):  # and again on fresh connections of the same rank
            again = wire.connect(address, wire.Credentials.of(SECRET, wire.rank_role(1)))
            again.send(big)
            assert hung_up(again.sock)
        assert settle(lambda: len(events) >= 1)
    finally:
        channel.close()
    assert [type(e) for e in events] == [RankFailed]  # before: 12 failures of 1 MiB each, kept until the stop
