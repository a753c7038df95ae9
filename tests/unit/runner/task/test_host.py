"""How a host explains a rank's end, and the environment it gives the processes it starts."""

from __future__ import annotations

import json

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.events import Failure
from airflow_provider_horovod.runner.exits import rank_exit_failure
from airflow_provider_horovod.runner.spec import RunSpec
from airflow_provider_horovod.runner.task.barrier import base_env
from airflow_provider_horovod.runner.launchers.mpirun import mpirun_failure, parse_mpirun_exit
from airflow_provider_horovod.runner.names import TaskDir
from airflow_provider_horovod.runner.plan import TaskFacts, make_plan

EXITED = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[29535,1],1]
  Exit code:    3
--------------------------------------------------------------------------""".splitlines()
SIGNALLED = "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).".splitlines()


def spec(launcher: str = "mpirun") -> RunSpec:
    return RunSpec(run_id="r", secret=b"s" * 32, payload=b"p", launcher=launcher, verbosity="all",
                   channel=("127.0.0.1", 1), env={"USER_VAR": "1"}, driver_python="3.11.2")


def plan_in(tmp_path, n: int = 2):
    tasks = [TaskDir(tmp_path / ("t%d" % p)) for p in range(n)]
    for t in tasks:
        t.path.mkdir()
    return make_plan([TaskFacts(partition=p, executor="e%d:1" % p, address="127.0.0.1", pid=1, task_dir=str(tasks[p].path),
                                python="3.11.2") for p in range(n)]), tasks


def test_mpiruns_words_name_the_rank_and_how_it_ended():
    assert parse_mpirun_exit(EXITED) == (1, 3)
    assert parse_mpirun_exit(SIGNALLED) == (1, -9)
    assert parse_mpirun_exit(["ORTE was unable to reliably start one or more daemons."]) is None


def test_a_rank_that_exits_without_a_report_is_named_with_its_exit_and_last_lines(tmp_path):
    plan, tasks = plan_in(tmp_path)
    tasks[1].rank_log(1).write_text("".join("line %d\n" % i for i in range(150)))
    tasks[0].mpirun_log.write_text("\n".join(EXITED))
    failure = mpirun_failure(plan, 1, tasks[0], stopping=False)
    assert failure.rank == 1 and failure.host == "hvdhost1" and failure.executor == "e1:1"
    assert failure.exit == "exited with code 3" and "Rank 1 on host hvdhost1" in failure.message
    assert len(failure.tail) == 100 and failure.tail[-1] == "line 149"
    assert failure.launcher_output[-2].strip() == "Exit code:    3"  # mpirun's words come after the rank's


def test_a_ranks_own_report_wins_over_mpiruns_words(tmp_path):
    plan, tasks = plan_in(tmp_path)
    own = Failure("Rank 1 failed: ValueError: boom", rank=1, exception="ValueError: boom", traceback="Traceback ...")
    tasks[1].error(1).write_text(json.dumps(own.to_json()))
    tasks[0].mpirun_log.write_text("\n".join(EXITED))
    failure = mpirun_failure(plan, 1, tasks[0], stopping=False)
    assert failure.exception == "ValueError: boom" and failure.launcher_output


def test_a_gloo_rank_killed_by_a_signal_says_which(tmp_path):
    plan, tasks = plan_in(tmp_path)
    tasks[1].rank_log(1).write_text("training step 7\n")
    failure = rank_exit_failure(plan.slots[1], -9, stopping=False)
    assert failure.exit == "was killed by SIGKILL" and failure.tail == ("training step 7",)
    assert rank_exit_failure(plan.slots[1], -15, stopping=True).consequence


def test_rank_processes_get_neither_a_drivers_horovod_contract_nor_sparks_worker_secret(monkeypatch, tmp_path):
    monkeypatch.setenv("HOROVOD_RANK", "5")
    monkeypatch.setenv("PYTHON_WORKER_FACTORY_SECRET", "spark-secret")
    env = base_env(spec("mpirun"), TaskDir(tmp_path))
    assert "HOROVOD_RANK" not in env and "PYTHON_WORKER_FACTORY_SECRET" not in env
    assert env["USER_VAR"] == "1" and env["HOROVOD_CONTROLLER"] == "mpi"
    assert env[names.ENV_PLAN] == str(tmp_path / names.PLAN_FILE)

def test_rank_processes_get_keras_2_unless_the_user_chose(monkeypatch, tmp_path):
    import dataclasses

    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    for launcher in ("mpirun", "gloo"):
        assert base_env(spec(launcher), TaskDir(tmp_path))["TF_USE_LEGACY_KERAS"] == "1"
    chosen = dataclasses.replace(spec(), env={"TF_USE_LEGACY_KERAS": "0"})  # the runner's env=
    assert base_env(chosen, TaskDir(tmp_path))["TF_USE_LEGACY_KERAS"] == "0"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "false")  # the executor's (or the driver's) own environment
    assert base_env(spec(), TaskDir(tmp_path))["TF_USE_LEGACY_KERAS"] == "false"



def test_folders_of_a_dead_owner_are_swept_and_a_live_owners_are_kept(tmp_path):
    import os
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = names.TASK_DIR_PREFIX % ("abc123", "p0", os.getpid())
    orphan_task = names.TASK_DIR_PREFIX % ("abc123", "p1", dead.pid)
    orphan_session = names.SESSION_DIR_PREFIX % dead.pid
    orphan_restart = names.TASK_DIR_PREFIX % ("abc123-1", "p1", dead.pid)  # a restart's attempt
    orphan_offers = names.OFFERS_DIR_PREFIX % dead.pid  # a driver killed before its channel closed
    for name in (mine + "x", orphan_task + "y", orphan_session + "z", orphan_restart + "w", orphan_offers + "v",
                 "unrelated-%d-" % dead.pid):
        (tmp_path / name).mkdir()
    removed = names.sweep_orphans(str(tmp_path))
    assert sorted(removed) == sorted([orphan_task + "y", orphan_session + "z", orphan_restart + "w", orphan_offers + "v"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine + "x", "unrelated-%d-" % dead.pid])
