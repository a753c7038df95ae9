"""The engine on a real ``local[2]`` SparkSession with real Horovod ranks and real mpirun."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_horovod import (
    ExecutorMismatchError,
    HorovodRunError,
    HorovodRunner,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
)
from airflow_provider_horovod.retry import Cause, judge
from tests.conftest import ours, wait_no_run_processes
from tests.integration import jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


def train_in_background(runner: HorovodRunner, tmp_path, job=jobs.slow_job) -> tuple[threading.Thread, list[BaseException]]:
    """Start a long training run of ``job`` (it touches its ``marker`` once training runs) in a
    thread; return once its ranks are training."""
    marker = tmp_path / "training"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run(job, steps=100000, marker=str(marker))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "training never started"
    return thread, errors


def run_folders_left(runner: HorovodRunner, timeout: float = 5.0) -> list[str]:
    """Wait until no task folder of the runner's last run is left in the temp folder; return those still there."""
    import tempfile

    prefix = "hvdrunner-%s-" % runner.last_run.run_id
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_two_ranks_return_rank_zeros_value(spark, launcher):
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    result = runner.run(jobs.allreduce_job, tag=launcher)
    assert result["tag"] == launcher
    assert result["sum"] == 3.0  # 1 + 2: both ranks took part in the allreduce
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["size"] for r in ranks} == {2}
    # local[2]: one executor, so one host with two local ranks
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in ranks] == [(0, 2, 0, 1), (1, 2, 0, 1)]
    assert {r["controller"] for r in ranks} == {"mpi" if launcher == "mpirun" else "gloo"}
    assert runner.last_run.result == result
    assert runner.last_run.coordination == "channel"  # no Spark allGather/barrier on the way
    assert runner.last_run.status == "success" and runner.last_run.np == 2
    assert 0 < runner.last_run.phases["facts"] <= runner.last_run.phases["start"] < runner.last_run.phases["released"]


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_negative_np_runs_local_processes_without_a_spark_job(launcher):
    from pyspark.sql import SparkSession

    before = SparkSession.getActiveSession()
    jobs_before = before.sparkContext.statusTracker().getJobIdsForGroup() if before else None
    result = HorovodRunner(-2, launcher=launcher).run(jobs.allreduce_job, tag="local")
    assert result["sum"] == 3.0 and [r["rank"] for r in result["ranks"]] == [0, 1]
    if before is not None:
        assert before.sparkContext.statusTracker().getJobIdsForGroup() == jobs_before


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_distributed_optimizer_step_keeps_ranks_in_sync(spark, launcher):
    weights = HorovodRunner(2, launcher=launcher, spark=spark).run(jobs.optimizer_step_job, lr=0.05)
    assert len(weights) == 2
    assert weights[0] == weights[1]  # broadcast + averaged gradients: identical after the step


def test_all_verbosity_streams_every_ranks_lines_tagged_with_rank(spark, caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_horovod.ranks")
    HorovodRunner(2, launcher="gloo", spark=spark).run(jobs.log_job)
    text = caplog.text
    assert "[rank 0] plain print from rank 0" in text
    assert "[rank 1] plain print from rank 1" in text
    assert "[rank 1] callback from rank 1" in text


def test_log_callback_only_streams_only_log_to_driver(spark, caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_horovod.ranks")
    result = HorovodRunner(2, launcher="mpirun", driver_log_verbosity="log_callback_only", spark=spark).run(jobs.log_job)
    assert result == (0, 2)
    assert "[rank 0] callback from rank 0" in caplog.text
    assert "[rank 1] callback from rank 1" in caplog.text
    assert "plain print" not in caplog.text


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_rank_failure_surfaces_remote_traceback(spark, launcher):
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(2, launcher=launcher, spark=spark).run(jobs.failing_job, fail_rank=1)
    assert time.monotonic() - started < 30
    err = info.value
    assert type(err) is HorovodRunError  # the user's own exception: HorovodRunError, as documented
    assert err.rank == 1
    assert err.host == "hvdhost0"
    assert "ValueError: boom from rank 1" in str(err)
    assert "failing_job" in err.remote_traceback  # the frame of the user's function, in the user's file and line
    assert 'File "%s", line' % jobs.__file__ in err.remote_traceback
    assert 'raise ValueError("boom from rank %d" % hvd.rank())' in err.remote_traceback
    assert judge(err).cause == Cause.USER_CODE  # HorovodRetryPolicy fails the task at once


@pytest.mark.parametrize(("np", "launcher"), [(2, "mpirun"), (-2, "gloo")])
def test_provider_exception_raised_in_a_rank_is_raised_on_the_driver_as_that_type(spark, np, launcher):
    with pytest.raises(Keras3NotSupportedError) as info:  # the except clause docs/how-to.md names
        HorovodRunner(np, launcher=launcher, spark=spark).run(jobs.provider_error_job, fail_rank=1)
    err = info.value
    assert isinstance(err, HorovodRunError)
    assert err.rank == 1 and err.host  # the rank and its host, as for any rank failure
    assert "Keras 3 object given to Horovod (raised by the test)" in str(err)
    assert "provider_error_job" in err.remote_traceback


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_rank_killed_with_sigkill_ends_the_run(spark, launcher):
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(2, launcher=launcher, spark=spark).run(jobs.sigkill_job, victim=1)
    assert time.monotonic() - started < 30
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value) or "signal 9" in str(info.value)
    assert judge(info.value).cause == Cause.LOST  # HorovodRetryPolicy retries it


@pytest.mark.parametrize("when", ["inside", "shutdown"])
@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_rank_that_exits_without_raising_is_named_with_its_exit_code_and_last_lines(spark, launcher, when):
    runner = HorovodRunner(2, launcher=launcher, spark=spark, driver_log_verbosity="log_callback_only")
    with pytest.raises(HorovodRunError) as info:
        runner.run(jobs.exit_job, victim=1, when=when, code=3)
    err, text = info.value, str(info.value)
    assert err.rank == 1 and err.host == "hvdhost0"
    assert text.startswith("Rank 1 on host hvdhost0 (executor ")  # the rank first; mpirun's words may follow
    assert "exited with code 3" in text
    assert "victim line 2" in text and err.log_tail[1][-1] == "victim line 2"  # its last lines, not streamed
    assert runner.last_run.error["rank"] == 1 and runner.last_run.status == "failed"


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_rank_that_hangs_after_another_failed_is_ended(spark, launcher):
    started = time.monotonic()
    with pytest.raises(HorovodRunError, match="rank 0 gives up"):
        HorovodRunner(2, launcher=launcher, spark=spark).run(jobs.hang_after_failure_job)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_cancel_mid_training_interrupts_the_job_and_leaves_no_process(spark, launcher, tmp_path):
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path)
    runner.cancel()
    cancelled_at = time.monotonic()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RunCancelledError)
    assert run_folders_left(runner) == []
    assert wait_no_run_processes(10.0 - (time.monotonic() - cancelled_at) + 2) == []
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []


LOGGING_SETUPS = {
    "none": "",
    "basicConfig": "logging.basicConfig()",  # a root at WARNING, which would drop INFO lines
    "basicConfig_info": "logging.basicConfig(level=logging.INFO)",
    "ranks_silenced": "logging.basicConfig(); logging.getLogger('airflow_provider_horovod.ranks').setLevel(logging.WARNING)",
}


@pytest.mark.parametrize(("setup", "verbosity", "stdout_lines", "stderr_lines", "absent"), [
    ("none", "all", ["[rank 0] plain print from rank 0", "[rank 1] callback from rank 1"], [], []),
    ("basicConfig", "all", ["[rank 0] plain print from rank 0", "[rank 1] callback from rank 1"], [], []),
    # np < 0: every rank's output whatever driver_log_verbosity says (as sparkdl's local mode)
    ("basicConfig", "log_callback_only", ["[rank 0] plain print from rank 0", "[rank 1] callback from rank 1"], [], []),
    ("basicConfig_info", "all", [], ["INFO:airflow_provider_horovod.ranks:[rank 0] plain print from rank 0",
                                     "INFO:airflow_provider_horovod.ranks:[rank 1] callback from rank 1"], []),
    ("ranks_silenced", "all", [], [], ["plain print", "callback from"]),
])
def test_rank_lines_reach_an_engine_user_whatever_the_logging_setup(setup, verbosity, stdout_lines, stderr_lines, absent):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import logging\n%s\n"
            "from airflow_provider_horovod import HorovodRunner\n"
            "from tests.integration import jobs\n"
            "print('RESULT', HorovodRunner(-2, launcher='gloo', driver_log_verbosity=%r).run(jobs.log_job))\n"
            % (LOGGING_SETUPS[setup], verbosity))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    assert out[-1] == "RESULT (0, 2)"
    rank_lines_on_stdout = [line for line in out if line.startswith("[rank ")]
    assert set(stdout_lines) <= set(rank_lines_on_stdout) and bool(stdout_lines) == bool(rank_lines_on_stdout), proc.stdout
    assert set(stderr_lines) <= set(err), proc.stderr[-3000:]
    assert [text for text in absent if text in proc.stdout + proc.stderr] == []


def test_unpicklable_return_value_fails_in_the_rank_saying_what_to_return_instead(tmp_path):
    runner = HorovodRunner(-1, launcher="gloo", artifact_dir=tmp_path / "run")
    with pytest.raises(PayloadError) as info:  # and a HorovodRunError naming the rank
        runner.run(jobs.unpicklable_result_job)
    err = info.value
    assert err.rank == 0
    assert "Rank 0's return value (a lock) cannot be pickled" in str(err)
    assert "save the object under runtime.checkpoint_dir()" in str(err)
    assert (tmp_path / "run" / "checkpoints" / "model.pt").read_bytes() == b"weights"  # the training is not lost


def test_an_engine_run_without_artifact_dir_keeps_rank_0s_checkpoint_in_a_run_folder_and_says_where(
        spark, caplog, capfd, engine_runs_dir):
    runner = HorovodRunner(2, launcher="gloo", spark=spark)
    with caplog.at_level(logging.INFO):
        assert runner.run(jobs.saves_a_checkpoint_job) == 2
    folder = Path(runner.last_run.artifact_dir)
    assert folder.parent == Path(engine_runs_dir) and folder.name.endswith("-" + runner.last_run.run_id)
    assert runner.last_run.checkpoint_path == str(folder / "checkpoints")
    assert (folder / "checkpoints" / "model.pt").read_bytes() == b"weights"
    assert (folder / "checkpoints" / "optimizer.pt").read_bytes() == b"state"
    said = caplog.text + "".join(capfd.readouterr())
    assert "Run %s kept its checkpoints in %s" % (runner.last_run.run_id, folder) in said
    assert "deleted with the task's folder" not in said


def test_unpicklable_kwarg_fails_before_any_spark_job(spark):
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup())
    with pytest.raises(PayloadError, match="keyword argument 'tag' \\(a lock"):
        HorovodRunner(2, spark=spark).run(jobs.allreduce_job, tag=threading.Lock())
    assert set(tracker.getJobIdsForGroup()) == jobs_before


def test_kwarg_the_function_does_not_take_fails_before_any_spark_job(spark):
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup())
    with pytest.raises(PayloadError, match="do not fit the training function allreduce_job.*unexpected keyword argument 'tags'"):
        HorovodRunner(2, spark=spark).run(jobs.allreduce_job, tags="x")
    assert set(tracker.getJobIdsForGroup()) == jobs_before


def test_reference_string_runs_and_a_bad_one_fails_early(spark):
    result = HorovodRunner(2, launcher="gloo", spark=spark).run("tests.integration.jobs:allreduce_job", tag="ref")
    assert result["tag"] == "ref" and result["sum"] == 3.0
    with pytest.raises(PayloadError, match="Cannot import module 'tests.integration.nope'"):
        HorovodRunner(2, spark=spark).run("tests.integration.nope:train")


def test_np_larger_than_a_local_masters_cores_fails_at_once_naming_the_slots(spark):
    started = time.monotonic()  # a local master never gains slots: no waiting for start_timeout
    with pytest.raises(HorovodRunError, match=r"the cluster has 2 \(the master local\[2\]\), and no executor can join"):
        HorovodRunner(3, spark=spark, start_timeout=120).run(jobs.allreduce_job)
    assert time.monotonic() - started < 15


def test_mpirun_missing_on_the_executor_is_a_clear_error(spark):
    with pytest.raises(ExecutorMismatchError, match="mpirun and orted not found on executor"):
        HorovodRunner(2, spark=spark, env={"PATH": "/nonexistent"}).run(jobs.allreduce_job)


def _task_python_workers() -> list:
    """The Spark Python workers that are running a barrier task of the runner right now."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "pyspark.daemon" not in " ".join(proc.info["cmdline"] or []) or not ours(proc):
                continue
            if any("airflow_provider_horovod" in " ".join(c.cmdline()) for c in proc.children()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_rank_exits_when_its_spark_task_dies(spark, launcher, tmp_path):
    import signal

    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path)
    victims = _task_python_workers()
    assert victims, "no barrier task found running ranks"
    victims[0].send_signal(signal.SIGKILL)  # as if the executor lost the task's Python worker
    killed_at = time.monotonic()
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], HorovodRunError)
    assert run_folders_left(runner) == []  # the killed task's folder (its janitor's work) and the other's
    assert wait_no_run_processes(10.0 - (time.monotonic() - killed_at) + 5) == []


def test_secret_never_appears_in_argv_logs_or_spark_conf(spark, monkeypatch, tmp_path, caplog, capfd):
    import psutil

    from airflow_provider_horovod.runner.driver import attempt as attempt_module

    secret = bytes(range(32))
    monkeypatch.setattr(attempt_module.wire, "new_secret", lambda: secret)
    caplog.set_level(logging.DEBUG)
    runner = HorovodRunner(2, launcher="mpirun", spark=spark)
    thread, errors = train_in_background(runner, tmp_path)
    argvs = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            argvs.append(" ".join(proc.info["cmdline"] or []))
        except psutil.Error:
            pass
    runner.cancel()
    thread.join(30)
    assert [type(e) for e in errors] == [RunCancelledError]
    assert any("airflow_provider_horovod.runner.rank.worker" in a for a in argvs)  # we looked while it ran
    for text in (*argvs, caplog.text, *capfd.readouterr(), str(spark.sparkContext.getConf().getAll())):
        assert secret.hex() not in text
        assert secret.hex().upper() not in text


def _one_run(tmp_path, conf: dict, **env: str) -> dict:
    """Run one job in a SparkSession of its own (another process), built with ``conf``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.scenarios.one_run", "local[2]", json.dumps(conf), str(out)],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root), **env), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _other_python() -> str | None:
    import glob
    import os
    import shutil
    import subprocess

    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[023]*/bin/python3.1[023]")))
    candidates += [p for p in (shutil.which("python3.12"), shutil.which("python3.10")) if p]
    for p in candidates:
        check = "import sys; assert sys.version_info[:2] != (3, 11)"
        if subprocess.run([p, "-c", check], capture_output=True).returncode == 0:
            return p
    return None


def test_python_version_mismatch_says_what_to_fix(tmp_path):
    other = _other_python()
    if other is None:
        pytest.skip("no second Python version on this machine")
    got = _one_run(tmp_path, {}, PYSPARK_PYTHON=other)  # the executors' Python, not the driver's
    assert got["error_type"] == "ExecutorMismatchError"  # a HorovodRunError that no retry fixes
    assert "differs from the driver's" in got["message"] and "PYSPARK_PYTHON" in got["message"]


def test_dynamic_allocation_is_refused_before_any_spark_job(tmp_path):
    got = _one_run(tmp_path, {"spark.dynamicAllocation.enabled": "true",
                              "spark.dynamicAllocation.shuffleTracking.enabled": "true"})
    assert got["error_type"] == "ClusterSettingsError"
    assert "spark.dynamicAllocation.enabled=false" in got["message"]
    assert got["spark_jobs"] == 0


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_without_a_reachable_driver_logs_and_errors_come_back_with_the_stage(spark, monkeypatch, caplog, launcher):
    # As with a Spark Connect session to a remote server: the executors cannot connect back.
    from airflow_provider_horovod.runner.driver.channel import Channel

    monkeypatch.setattr(Channel, "start", lambda self, host: None)
    caplog.set_level(logging.INFO, logger="airflow_provider_horovod.ranks")
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    result = runner.run(jobs.allreduce_job, tag="no-channel")
    assert result["sum"] == 3.0 and runner.last_run.coordination == "spark"
    assert "[rank 1] rank 1 says hello no-channel" in caplog.text
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(2, launcher=launcher, spark=spark).run(jobs.failing_job, fail_rank=1)
    assert info.value.rank == 1 and "boom from rank 1" in str(info.value)


# Runs of one driver, each interrupted as its user would: SIGTERM to the driver (Airflow's cancel),
# or Ctrl-C in a terminal (SIGINT to the driver's process group: PySpark's own handler cancels the
# Spark jobs, and Spark kills the tasks' Python workers with no time to clean up). The last run's
# Ctrl-C also ends the script, and with it the Spark JVM and its Python workers.
CANCEL_STEPS = [("mpirun", 2, "SIGTERM"), ("gloo", -2, "SIGTERM"), ("gloo", 2, "SIGINT"), ("torch", 2, "SIGINT"),
                ("mpirun", 2, "SIGINT")]


def _task_folders(root) -> list:
    return sorted(p for p in root.iterdir() if p.name.startswith(("hvdrunner-", "hvdo-")))


def test_sigterm_or_ctrl_c_to_the_driver_cancels_the_job_and_leaves_no_process_task_folder_or_key(tmp_path):
    import queue
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    temp = tmp_path / "tmp"  # the driver's and its tasks' temp folder: where every task folder goes
    temp.mkdir()
    steps = ",".join("%s:%d" % (launcher, np) for launcher, np, _ in CANCEL_STEPS)
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.scenarios.sigterm_driver", steps, str(tmp_path)],
                            cwd=root, env=dict(os.environ, PYTHONPATH=str(root), TMPDIR=str(temp)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a terminal's foreground process group of its own
    lines: queue.Queue = queue.Queue()
    output: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def said(text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                output.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return False
            if output[-1].startswith(text):
                return True
        return False

    try:
        for i, (launcher, np, signame) in enumerate(CANCEL_STEPS):
            step = "step %d (%s, np=%d, %s)" % (i, launcher, np, signame)
            marker = tmp_path / ("step-%d" % i)
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert marker.exists(), "%s: training never started\n%s" % (step, "".join(output)[-3000:])
            first = next(p for p in _task_folders(temp) if "-p0-" in p.name or "-local-" in p.name)
            assert (first / "payload.pkl").exists(), step  # the check below would see a folder left behind
            if launcher == "mpirun" and np > 0:
                assert (first / "exec.key").exists(), step
            if signame == "SIGINT":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            assert said("CANCELLED %d:" % i, 30), "%s: not cancelled\n%s" % (step, "".join(output)[-3000:])
            while _task_folders(temp) and time.monotonic() - sent < 5:
                time.sleep(0.05)
            assert _task_folders(temp) == [], step  # its payload, its keys, partition 0's exec.key
            assert wait_no_run_processes(max(1.0, 10.0 - (time.monotonic() - sent))) == [], step
            if i < len(CANCEL_STEPS) - 1:
                proc.stdin.write("next\n")
                proc.stdin.flush()
        assert proc.wait(timeout=30) == 3, "".join(output)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _task_folders(temp) == []


class _Alarm(Exception):
    """What a SIGALRM handler raises, as Airflow's execution_timeout raises AirflowTaskTimeout."""


def test_an_error_raised_into_run_by_a_signal_handler_cancels_the_run_and_keeps_rank_0s_checkpoint(tmp_path):
    marker = tmp_path / "checkpointed"
    runner = HorovodRunner(-2, artifact_dir=tmp_path / "artifacts")

    def on_alarm(signum, frame):
        raise _Alarm("execution_timeout")

    def alarm_once_checkpointed() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGALRM)  # handled in the main thread, inside run()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    alarm = threading.Thread(target=alarm_once_checkpointed, daemon=True)
    alarm.start()
    try:
        with pytest.raises(_Alarm):  # the caller's own error comes back, after a clean cancel
            runner.run(jobs.checkpoint_then_sleep_job, step=5, marker=str(marker))
    finally:
        alarm.join(70)
        signal.signal(signal.SIGALRM, previous)
    assert marker.exists(), "rank 0 never checkpointed"
    assert runner.last_run.status == "cancelled"
    committed = json.loads((tmp_path / "artifacts" / "_RUN.json").read_text())
    assert committed["status"] == "cancelled" and committed["complete"] is True
    assert (tmp_path / "artifacts" / "checkpoints" / "step.txt").read_text() == "5"


def test_executor_without_the_package_fails_with_one_line_naming_host_interpreter_and_fix(tmp_path):
    """An executor whose interpreter lacks the package (a bare virtualenv here), as on a cluster
    whose executors were not given the driver's environment."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python, out = str(venv / "bin" / "python"), tmp_path / "out.json"
    scenario = Path(__file__).parent / "scenarios" / "bare_executor.py"
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, str(scenario), python, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["error_type"] == "ExecutorMismatchError"
    message = got["message"]
    assert "\n" not in message and "org.apache.spark" not in message, message
    assert message.startswith("The executor on host ") and (" runs %s" % python) in message, message
    assert "cannot import" in message and "PYSPARK_PYTHON" in message and "spark.archives" in message


def test_hook_session_on_a_local_master_gives_the_executors_the_driver_interpreter(tmp_path):
    """No PYSPARK_PYTHON anywhere: the executors would run ``python3`` from the PATH, which lacks the package.
    And the next task of the process with other Spark conf gets a session with its own conf, nothing of the
    first task's (which started the JVM); conf only a new JVM could apply is refused, naming it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out.json"
    scenario = Path(__file__).parent / "scenarios" / "hook_local_python.py"
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW_CONN_SPARK_LOCAL=json.dumps({"conn_type": "spark", "host": "local[2]"}))
    proc = subprocess.run([sys.executable, str(scenario), "spark_local", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    refused = got["next_task"].pop("jvm_conf")
    assert got == {"rank_python": sys.executable, "conf": sys.executable, "next_task": {
        "fresh": True, "first_stopped": True, "conf": None, "reused_when_the_same": True}}  # not the first task's 7
    assert "has other Spark conf (spark.task.maxFailures): stopping it and starting this task's own" in proc.stderr + proc.stdout
    assert refused.startswith("SparkConnectionError: This task's Spark conf cannot take effect: this process's Spark "
                              "JVM was started by an earlier task"), refused
    assert "spark.driver.memory is '3g' here, unset in the JVM" in refused and "airflow dags test" in refused



def test_an_executor_with_another_horovod_build_is_refused_before_any_rank_starts(spark, tmp_path):
    # The executors' Python workers (only theirs: sc.environment is spark.executorEnv.*) find another
    # Horovod first on their PYTHONPATH: one as PyPI's sdist builds it, without any extension.
    from airflow_provider_horovod import ExecutorMismatchError
    from airflow_provider_horovod.runner.environment import horovod_build

    sdist_build = tmp_path / "pypi-horovod" / "horovod"
    sdist_build.mkdir(parents=True)
    (sdist_build / "__init__.py").write_text("__version__ = '0.28.1'\n")
    environment = spark.sparkContext.environment
    environment["PYTHONPATH"] = str(sdist_build.parent)
    try:
        runner = HorovodRunner(2, spark=spark)  # mpirun: a Gloo task starts Horovod's rendezvous before it reports
        with pytest.raises(ExecutorMismatchError) as info:
            runner.run(jobs.allreduce_job)
    finally:
        del environment["PYTHONPATH"]
    message = str(info.value)
    assert "Horovod horovod 0.28.1 (no framework; no MPI, no Gloo) here, %s on the driver" % horovod_build().describe() \
        in message
    assert "The executor " in message and "(partition 0)" in message and "spark.archives" in message
    assert "start" not in runner.last_run.phases and runner.last_run.status == "failed"
