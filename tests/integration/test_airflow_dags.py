"""End to end through Airflow: ``airflow dags test`` in a throwaway AIRFLOW_HOME on SQLite.

Each test runs the real CLI code, so the task runs exactly as it does under ``airflow dags test``
for a user: real parsing of the DAGs folder, real templating, real XCom and asset events in the
metadata database, real Spark ``local[2]``, real Horovod ranks and mpirun. Assertions read the
results back from the metadata database and from the artifact store.

The CLI's process: the SIGTERM test starts the ``airflow`` console script itself (a new
interpreter, as a user types it) and signals it. Every other test runs the same CLI code,
``airflow.__main__.main()`` with the same argv, in a process forked from one server per module
that has already imported Airflow and built the in-process execution API: what each ``airflow dags
test`` spends on those before its first task starts (~5 s of one core on an idle machine here, ~12 s
on a busy one) is paid once (``tests/integration/airflow_home.py``).

Retries: ``airflow dags test`` runs a failed task's retries itself (up_for_retry -> scheduled again
once ``retry_delay`` has passed), so the retry test is a plain ``dags test`` with ``retries=1`` and
``retry_delay=0``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import quote

import cloudpickle
import psutil
import pytest

from tests.conftest import wait_no_run_processes
from tests.integration.airflow_home import AIRFLOW, DAG_TIMEOUT_S, REPO, AirflowHome

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

# Two tries of a Keras training task (each starts 2 ranks that import TensorFlow, ~20-60 s on a busy
# 2-core machine) plus an evaluation that imports it again: 5.5 min seen here at load 15.
KERAS_DAG_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def airflow(request, tmp_path_factory):
    # The MLflow server (its test is the module's last) starts first, so that its start-up (~6 s,
    # mostly one core) runs beside the home's (db migrate, then the dags-test server: one core each);
    # only when its test was selected (test_lowest_versions.py runs one test of this module).
    if any("mlflow_server" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("mlflow_process")
    home = AirflowHome(tmp_path_factory.mktemp("airflow-e2e"))
    try:
        home.start_server()
        yield home
    finally:
        home.close()


def local(uri: str) -> Path:
    assert uri.startswith("file://"), uri
    return Path(uri[len("file://"):])


def explain(proc: subprocess.CompletedProcess) -> str:
    return "rc=%s\n--- stdout (tail)\n%s\n--- stderr (tail)\n%s" % (proc.returncode, proc.stdout[-6000:], proc.stderr[-6000:])


def test_digits_example_trains_evaluates_and_publishes_the_model(airflow):
    proc = airflow.dags_test("horovod_digits_train")
    assert proc.returncode == 0, explain(proc)
    assert airflow.task_states("horovod_digits_train") == {
        "write_digits": ("success", 1), "train": ("success", 1), "evaluate": ("success", 1)}
    day = airflow.xcom("horovod_digits_train", "write_digits")  # the day's Parquet folder of the digits table
    assert Path(day, "digits.parquet").stat().st_size > 0 and Path(day).parent == airflow.home / "horovod-data" / "digits"
    assert "rows in 2 shards of 673 to 674 rows" in proc.stdout + proc.stderr  # 1347 training rows via dataset=

    summary = airflow.xcom("horovod_digits_train", "train")  # @task.horovod: the function's own value
    assert summary["epochs"] == 8 and summary["ranks"] == 2 and set(summary) == {"epochs", "loss", "ranks"}
    trained = {name: airflow.xcom("horovod_digits_train", "train", "horovod_" + name)
               for name in ("artifacts_uri", "checkpoint_uri", "timeline_uri", "try_number", "duration_s")}
    assert trained["try_number"] == 1 and trained["duration_s"] > 0
    store = local(trained["artifacts_uri"])
    # runtime.report every step: the newest values, metrics.jsonl (coalesced, in step order) and the progress line
    metrics = airflow.xcom("horovod_digits_train", "train", "horovod_metrics")
    assert metrics["step"] == metrics["total_steps"] == 8 * 22 and 0 < metrics["loss"] < 1 and 0.5 < metrics["acc"] <= 1
    from airflow_provider_horovod.store import read_metrics, storage_path

    kept = read_metrics(storage_path(trained["artifacts_uri"]), max_rows=10**6)  # metrics/<n>.jsonl, in order
    assert kept[-1]["step"] == metrics["step"] and kept[-1]["values"] == {"loss": metrics["loss"], "acc": metrics["acc"]}
    assert [row["step"] for row in kept] == sorted({row["step"] for row in kept}) and len(kept) < metrics["step"]
    assert "Horovod progress: step %d/%d (100%%), loss" % (metrics["step"], metrics["step"]) in proc.stdout + proc.stderr
    assert store.parts[-4:] == ("horovod_digits_train", airflow.last_run_id("horovod_digits_train"), "train", "try-1")
    assert json.loads((store / "_ARTIFACTS.json").read_text())["status"] == "success"
    assert (local(trained["checkpoint_uri"]) / "model.pt").stat().st_size > 0
    assert isinstance(json.loads(local(trained["timeline_uri"]).read_text()), (list, dict))  # valid Chrome trace
    assert (store / "timeline.svg").exists()
    run = quote(airflow.last_run_id("horovod_digits_train"), safe="")
    assert airflow.xcom("horovod_digits_train", "train", "horovod_timeline_url") == (
        "/dags/horovod_digits_train/runs/%s/tasks/train/plugin/horovod" % run)  # the Horovod tab of the UI
    spark_ui = airflow.query("SELECT value FROM xcom WHERE dag_id = ? AND task_id = 'train' AND key = 'horovod_spark_ui_url'",
                             "horovod_digits_train")
    assert all(json.loads(v) in ("", None) for (v,) in spark_ui)  # no History Server named: no dead :4040 link

    evaluated = airflow.xcom("horovod_digits_train", "evaluate")
    assert evaluated["accuracy"] >= 0.90
    assert "Held-out accuracy" in proc.stdout + proc.stderr

    (extra,) = airflow.asset_extras("horovod_digits_model")
    assert extra["checkpoint_uri"] == trained["checkpoint_uri"]
    assert extra["timeline_uri"] == trained["timeline_uri"]
    assert extra["try_number"] == 1
    assert extra["result"] == summary
    assert extra["metrics"] == metrics


def published_model(airflow: AirflowHome) -> dict:
    """The newest asset event of the digits model: the test above made one; run alone, this makes it."""
    if not airflow.asset_extras("horovod_digits_model"):
        proc = airflow.dags_test("horovod_digits_train")
        assert proc.returncode == 0, explain(proc)
    return airflow.asset_extras("horovod_digits_model")[-1]


def test_retrain_example_fine_tunes_from_the_published_checkpoint(airflow):
    published = published_model(airflow)
    proc = airflow.dags_test("horovod_digits_retrain")
    assert proc.returncode == 0, explain(proc)
    assert airflow.xcom("horovod_digits_retrain", "latest_checkpoint") == published["checkpoint_uri"]
    tuned = airflow.xcom("horovod_digits_retrain", "fine_tune")
    assert tuned["result"]["fine_tuned_from_epoch"] == 8 and tuned["result"]["epochs"] == 10
    assert tuned["checkpoint_uri"] != published["checkpoint_uri"]
    assert airflow.xcom("horovod_digits_retrain", "evaluate")["accuracy"] >= 0.90
    assert "Resuming from checkpoint %s" % published["checkpoint_uri"] in proc.stdout + proc.stderr
    (run_date,) = airflow.query("SELECT COALESCE(logical_date, run_after) FROM dag_run WHERE run_id = ?",
                                airflow.last_run_id("horovod_digits_retrain"))[0]
    assert "WHERE day <= '%s'" % str(run_date)[:10] in proc.stdout + proc.stderr  # the templated query, rendered
    assert ": 1347 rows in 2 shards" in proc.stdout + proc.stderr  # every day up to this run's (one here)


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="needs scripts/setup --with tensorflow")
def test_keras_digits_example_restarts_from_its_checkpoint_in_the_same_try_and_reaches_the_accuracy(airflow):
    import h5py

    proc = airflow.dags_test("horovod_keras_digits", "--conf", json.dumps({"fail_first_try_after_epoch": 3}),
                             timeout=KERAS_DAG_TIMEOUT_S)
    assert proc.returncode == 0, explain(proc)
    assert airflow.task_states("horovod_keras_digits") == {"train": ("success", 1), "evaluate": ("success", 1)}
    trained = airflow.xcom("horovod_keras_digits", "train")  # @task.horovod: the function's value
    assert (trained["resumed_after_epoch"], trained["epochs"], trained["ranks"]) == (3, 8, 2)
    assert airflow.xcom("horovod_keras_digits", "train", "horovod_try_number") == 1
    lost, resumed = airflow.xcom("horovod_keras_digits", "train", "horovod_attempts")  # one try, two attempts
    assert lost["ending"] == "lost" and "SIGKILL" in lost["cause"]
    assert resumed["ending"] == "success" and resumed["resumed_from"]["step"] is None  # a rename-rule version
    stored = local(airflow.xcom("horovod_keras_digits", "train", "horovod_artifacts_uri"))
    checkpoint = local(airflow.xcom("horovod_keras_digits", "train", "horovod_checkpoint_uri"))
    marker = json.loads((stored / "_ARTIFACTS.json").read_text())
    assert stored.name == "try-1" and marker["status"] == "success"
    assert [a["ending"] for a in marker["attempts"]] == ["lost", "success"]  # the view's row per attempt
    with h5py.File(checkpoint / "model.h5", "r") as saved:
        assert saved.attrs["epoch"] == 8
    output = proc.stdout + proc.stderr
    assert "fail_first_try_after_epoch=3: this try's ranks are killed on purpose" in output
    assert "rank 0 resumes after epoch 3" in output and "rank 1 resumes after epoch 3" in output
    assert "epoch 4: loss" in output and "epoch 8: loss" in output
    assert airflow.xcom("horovod_keras_digits", "evaluate")["accuracy"] >= 0.90


@pytest.fixture(scope="module")
def tasks_run(airflow) -> subprocess.CompletedProcess:
    """One ``airflow dags test hvd_test_tasks`` for the tests that read its tasks."""
    return airflow.dags_test("hvd_test_tasks")


POLICY_TASKS = {"slots_on_a_local_master": ("failed", 1), "crashes_by_itself": ("failed", 1),
                "killed_then_retried": ("success", 2)}


def test_reference_string_operator_and_task_horovod_decorator(airflow, tasks_run):
    proc = tasks_run
    states = airflow.task_states("hvd_test_tasks")
    assert {task: state for task, state in states.items() if task not in POLICY_TASKS} == {
        task: ("success", 1) for task in ("by_reference", "decorated", "unrolled", "ddp", "torch_by_reference")
    }, explain(proc)
    by_reference = airflow.xcom("hvd_test_tasks", "by_reference")
    assert by_reference["result"] == 2  # runtime.size() on rank 0 of np="{{ params.ranks }}" = 2 ranks
    assert (by_reference["np"], by_reference["launcher"]) == (2, "gloo")
    assert by_reference["checkpoint_uri"] is None and by_reference["timeline_uri"] is None

    stored = airflow.xcom("hvd_test_tasks", "decorated")  # not JSON: the XCom says where the value is stored
    assert stored["type"] == "builtins.set" and stored["format"] == "cloudpickle"
    assert stored["artifact_uri"] == airflow.xcom("hvd_test_tasks", "decorated", "horovod_artifacts_uri") + "/result.pkl"
    assert cloudpickle.loads(local(stored["artifact_uri"]).read_bytes()) == {frozenset({"sum"}), 30.0}
    assert "[rank 1] allreduce sum 3.0" in proc.stdout + proc.stderr  # rank output streams into the task log

    # multiple_outputs=True unrolls the function's dict, as for @task; the metadata keeps its own keys
    assert airflow.xcom("hvd_test_tasks", "unrolled", "loss") == 0.5
    assert airflow.xcom("hvd_test_tasks", "unrolled", "epochs") == [1, 2]
    assert airflow.xcom("hvd_test_tasks", "unrolled", "horovod_try_number") == 1
    assert airflow.xcom("hvd_test_tasks", "unrolled", "horovod_checkpoint_uri") is None
    assert "XCom not found" not in proc.stdout + proc.stderr  # every extra link's key was pushed

    # launcher="torch": the decorator and the operator run torch.distributed code, with checkpoints and logs
    assert airflow.xcom("hvd_test_tasks", "ddp") == 30.0
    assert (local(airflow.xcom("hvd_test_tasks", "ddp", "horovod_checkpoint_uri")) / "sum.pt").exists()
    assert "[rank 1] torch all_reduce sum 3.0" in proc.stdout + proc.stderr
    torch_by_reference = airflow.xcom("hvd_test_tasks", "torch_by_reference")
    assert (torch_by_reference["result"], torch_by_reference["launcher"]) == (2, "torch")


def test_the_default_retry_policy_decides_as_its_table_says_under_dags_test(airflow, tasks_run):
    """Too few slots on local[2] and a rank's own SIGABRT fail at once with retries left; a rank SIGKILLed is
    retried after the task's own retry_delay (2 s), not the policy's 30 s."""
    output = tasks_run.stdout + tasks_run.stderr
    states = airflow.task_states("hvd_test_tasks")
    assert {task: states.get(task) for task in POLICY_TASKS} == POLICY_TASKS, explain(tasks_run)
    assert re.search(r"Not retried \(no retry fixes it\): the cluster's barrier slots cannot grow \(FixedSlotsError: "
                     r"np=3 needs 3 barrier slots, but the cluster has 2", output), explain(tasks_run)
    assert re.search(r"Not retried \(user code\): rank 1 on \S+ was killed by SIGABRT, a signal of its own: a crash",
                     output), explain(tasks_run)
    assert "Retried after the task's retry_delay (2 s) if retries are left (lost infrastructure): rank 1" in output
    assert airflow.xcom("hvd_test_tasks", "killed_then_retried") == {"try": 2}
    [(first_end,)] = airflow.query(
        "SELECT end_date FROM task_instance_history WHERE dag_id = ? AND task_id = ? AND run_id = ? AND try_number = 1",
        "hvd_test_tasks", "killed_then_retried", airflow.last_run_id("hvd_test_tasks"))
    [(second_start,)] = airflow.query("SELECT start_date FROM task_instance WHERE dag_id = ? AND task_id = ? AND run_id = ?",
                                      "hvd_test_tasks", "killed_then_retried", airflow.last_run_id("hvd_test_tasks"))
    from datetime import datetime

    waited = (datetime.fromisoformat(str(second_start)) - datetime.fromisoformat(str(first_end))).total_seconds()
    assert 2 <= waited < 30, waited  # the task's retry_delay, not the policy's lost_delay


# The first try's version 4, where the retry test's store fails (and nowhere else), and what the error says:
# on file:// the disk is full at that object; on s3:// the S3 server's connection is reset at that key.
VERSION_4 = "flaky/try-1/versions/000004/step.txt"
STORE_FAILURE = {"file": r"OSError: \[Errno 28\] No space left on device",
                 "s3": r"EndpointConnectionError: Could not connect to the endpoint URL: \"http://127\.0\.0\.1:\d+/\S+/" +
                       re.escape(VERSION_4)}


def full_disk_at_version_4(root: Path) -> threading.Thread:
    """``VERSION_4`` of the coming ``hvd_test_retry`` run under ``root`` made a link to ``/dev/full`` as
    soon as the try's folder is there (the run id is known only then, seconds before the first version)."""
    def link() -> None:
        deadline = time.monotonic() + DAG_TIMEOUT_S
        while not (runs := list(root.glob("hvd_test_retry/*"))) and time.monotonic() < deadline:
            time.sleep(0.05)
        (runs[0] / VERSION_4).parent.mkdir(parents=True, exist_ok=True)
        (runs[0] / VERSION_4).symlink_to("/dev/full")

    thread = threading.Thread(target=link, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("where", ["file", "s3"])
def test_retry_resumes_from_the_checkpoint_of_the_failed_try(airflow, where, request, monkeypatch):
    """The first try commits checkpoint versions 1-4 while it trains (keep_checkpoints=2) and the
    store fails at version 4's object: the upload failure is logged and listed in the try's marker,
    training goes on, and the try fails by its own exception with its final checkpoint stored. The
    retry resumes from that checkpoint; the view reads both tries from the same store."""
    from airflow_provider_horovod import store
    from airflow_provider_horovod.plugins.view import tries_json

    gate = None
    if where == "s3":  # the artifact root in a bucket of the real S3 server, through a gate that fails at VERSION_4
        from tests import s3

        gate = s3.Gate(request.getfixturevalue("s3_server"))
        request.addfinalizer(gate.close)
        gate.deny = ("/" + VERSION_4).encode()
        root = s3.uri(gate.upstream.new_bucket(), "artifacts", conn_id=gate.conn_id)
        env = {"AIRFLOW__HOROVOD__ARTIFACT_ROOT": root, **gate.environment()}
    else:
        root = "file://%s" % (airflow.root / "retry-store")
        env = {"AIRFLOW__HOROVOD__ARTIFACT_ROOT": root}
        full_disk_at_version_4(airflow.root / "retry-store")
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the view, below, reads the same store in this process
    proc = airflow.dags_test("hvd_test_retry", env=env)
    assert proc.returncode == 0, explain(proc)
    if gate is not None:
        gate.deny = None  # the reads below see the store as it was left
    run_id = airflow.last_run_id("hvd_test_retry")
    first_store = store.try_folder(store.task_folder(root, "hvd_test_retry", run_id, "flaky"), 1)
    assert airflow.task_states("hvd_test_retry") == {"flaky": ("success", 2)}
    assert airflow.xcom("hvd_test_retry", "flaky") == {"resumed_step": 42, "rank": 0}
    assert airflow.xcom("hvd_test_retry", "flaky", "horovod_try_number") == 2
    uri = airflow.xcom("hvd_test_retry", "flaky", "horovod_artifacts_uri")
    assert uri.startswith(where + "://"), uri
    second_store = store.storage_path(uri)
    assert str(second_store.parent / "try-1") == str(first_store)
    first_marker = json.loads((first_store / "_ARTIFACTS.json").read_text())
    assert first_marker["status"] == "failed"
    assert (first_store / "checkpoints" / "step.txt").read_text() == "41"
    assert second_store.name == "try-2"
    second_marker = json.loads((second_store / "_ARTIFACTS.json").read_text())
    assert second_marker["resumed_from"] == str(first_store / "checkpoints")  # what the Horovod view shows
    assert first_marker["error"]["exception"] == "RuntimeError: first try fails after its checkpoint"
    assert airflow.xcom("hvd_test_retry", "flaky", "horovod_checkpoint_uri") == str(second_store / "checkpoints")
    assert (second_store / "checkpoints" / "step.txt").read_text() == "42"

    # Version 4 did not reach the store: its error names the URI and the cause, in the task log and in
    # the try's marker; training went on (the try failed by its own exception, above).
    failed = re.escape("Cannot commit checkpoint version 4 to %s (" % (first_store / "versions" / "000004"))
    [lost] = first_marker["not_stored"]
    assert lost["seq"] == 4 and re.match(failed + STORE_FAILURE[where], lost["reason"]), lost
    assert re.search(failed + STORE_FAILURE[where], proc.stdout + proc.stderr)
    # keep_checkpoints=2: version 1 was pruned (its objects gone) once 3 was committed; 4 has no marker
    committed = store.versions(first_store)
    assert [(v.seq, (path / "step.txt").read_text()) for v, path in committed] == [(2, "39"), (3, "40")]
    assert not (first_store / "versions" / "000001" / "step.txt").exists()
    assert not (first_store / "versions" / "000004" / "_VERSION.json").exists()
    # The Horovod view's reading (the functions behind .../tries), on the same store
    tries = tries_json("hvd_test_retry", run_id, "flaky")["tries"]
    assert [(t["try_number"], t["status"], t["committed"], t["resumed_from"], t["resumed_from_try"]) for t in tries] == [
        (1, "failed", True, None, None), (2, "success", True, str(first_store / "checkpoints"), 1)]
    assert [(v["seq"], v["uri"]) for v in tries[0]["versions"]] == [(v.seq, str(path)) for v, path in committed]
    assert [c["path"] for c in tries[0]["checkpoints"]] == [c["path"] for c in tries[1]["checkpoints"]] == [
        "checkpoints/step.txt"]
    assert tries[0]["error"]["exception"] == first_marker["error"]["exception"]


def test_sigterm_cancels_the_spark_job_and_leaves_no_process(airflow):
    # The one test on the ``airflow`` console script itself (a new interpreter, as a user starts it):
    # the CLI's own start-up, parsing the DAGs folder, and a signal to the process that runs the task.
    proc = subprocess.Popen([AIRFLOW, "dags", "test", "hvd_test_kill"], env=airflow.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "training step 3" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(DAG_TIMEOUT_S), "training never started:\n" + "".join(lines[-80:])
        children = psutil.Process(proc.pid).children(recursive=True)
        family = [proc.pid] + [p.pid for p in children]
        # the JVM has a session of its own: Airflow's SIGTERM to the task's process group misses it
        java = [p.pid for p in children if p.name() == "java"]
        assert java and all(os.getsid(pid) != os.getsid(proc.pid) for pid in java)
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(120)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    output = "".join(lines)
    assert took < 60, output[-4000:]
    assert wait_no_run_processes(15) == []
    # The Spark JVM exits on its own once its driver is gone (stdin closed); it no longer holds this
    # test's stdout pipe (its output goes to the task log), so wait for it here, within 10 s.
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in family if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == []
    assert "Cancelling the Horovod job" in output
    assert airflow.task_states("hvd_test_kill")["forever"][0] == "failed"
    run_id = airflow.last_run_id("hvd_test_kill")
    marker = airflow.artifacts / "hvd_test_kill" / run_id / "forever" / "try-1" / "_ARTIFACTS.json"
    assert json.loads(marker.read_text())["status"] == "cancelled"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_artifact_limits_set_on_the_operator_reach_the_engine(airflow):
    proc = airflow.dags_test("hvd_test_limits")
    output = proc.stdout + proc.stderr
    states = airflow.task_states("hvd_test_limits")
    assert {task: state for task, (state, _) in states.items()} == {"too_many_files": "failed"}, explain(proc)
    assert "max_artifact_files" in output
    run_id = airflow.last_run_id("hvd_test_limits")
    marker = json.loads((airflow.artifacts / "hvd_test_limits" / run_id / "too_many_files" / "try-1" / "_ARTIFACTS.json").read_text())
    assert marker["status"] == "failed"
    assert not (airflow.artifacts / "hvd_test_limits" / run_id / "too_many_files" / "try-1" / "checkpoints").exists()


def test_bad_input_fails_before_training_with_errors_that_name_the_fix(airflow):
    proc = airflow.dags_test("hvd_test_bad_input")
    output = proc.stdout + proc.stderr
    states = airflow.task_states("hvd_test_bad_input")
    assert {task: state for task, (state, _) in states.items()} == {
        "np_not_an_int": "failed", "reference_does_not_import": "failed", "unwritable_root": "failed",
        "kwargs_do_not_fit": "failed", "resume_not_a_uri": "failed",
    }, explain(proc)
    assert "np must be a non-zero int after templating" in output and "'two'" in output
    assert "unexpected keyword argument 'epochs'" in output
    assert "resume must be 'auto', 'never', or the URI of a checkpoint" in output and "'sometimes'" in output
    assert "XCom not found" not in output  # the link keys were pushed before the first check
    assert "Cannot import module 'no_such_pkg_hvd.train'" in output
    assert "Cannot write Horovod artifacts under file:///proc/hvd-cannot-write-here" in output
    assert "Starting Horovod job" not in output and "Starting a SparkSession" not in output


def test_the_first_dag_page_runs_as_written_and_its_evaluate_reads_the_checkpoint(airflow):
    """docs/first-dag.md: its DAG file and the helper module beside it (shipped by value), under
    ``airflow dags test``; the logs, artifacts and XComs are where the page says."""
    from tests.snippets import FIRST_DAG, files

    for name, code in files(FIRST_DAG).items():
        if name.startswith("dags/"):
            (airflow.dags / Path(name).name).write_text(code)
    proc = airflow.dags_test("first_training")
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout + proc.stderr
    assert airflow.task_states("first_training") == {"train": ("success", 1), "evaluate": ("success", 1)}
    assert airflow.xcom("first_training", "train") == {"loss": pytest.approx(0, abs=0.05), "ranks": 2, "rows": 512}
    assert "[rank 1] epoch 4: loss " in out and "Horovod progress: step 5/5 (100%), loss" in out
    assert "Horovod summary: succeeded; 2 ranks with mpirun" in out

    evaluated = airflow.xcom("first_training", "evaluate")  # read back through ObjectStoragePath
    assert evaluated["epoch"] == 4 and evaluated["bias"] == pytest.approx(1, abs=0.1)
    assert evaluated["weights"] == [pytest.approx(2, abs=0.1), pytest.approx(-3, abs=0.1)]
    assert "Learned weights" in out

    run_id = airflow.last_run_id("first_training")
    folder = local(airflow.xcom("first_training", "train", "horovod_artifacts_uri"))
    assert folder == airflow.artifacts / "first_training" / run_id / "train" / "try-1"
    assert json.loads((folder / "_ARTIFACTS.json").read_text())["complete"] is True
    assert local(airflow.xcom("first_training", "train", "horovod_checkpoint_uri")) == folder / "checkpoints"
    assert (folder / "checkpoints" / "model.pt").is_file() and (folder / "timeline.json").is_file()
    assert 1 <= len(list((folder / "versions").iterdir())) <= 2  # keep_checkpoints=2
    assert airflow.xcom("first_training", "train", "horovod_metrics")["step"] == 5
    assert not (airflow.home / "logs" / "dag_id=first_training").exists()  # dags test: the terminal only


@pytest.fixture(scope="module")
def mlflow_process(tmp_path_factory):
    """A real ``mlflow server`` (from .venv-mlflow/, which scripts/setup makes) with its own
    SQLite backend store and artifact folder, on a free port of 127.0.0.1: started, not waited for
    (``mlflow_server`` waits)."""
    from tests.integration.deployment import free_port

    server_bin = REPO / ".venv-mlflow" / "bin" / "mlflow"
    assert server_bin.exists(), "%s missing: run scripts/setup (it makes the MLflow server's venv)" % server_bin
    root, port = tmp_path_factory.mktemp("mlflow"), free_port()
    # Without MLflow's job runner: its huey consumers (6 processes, each importing mlflow) cost ~20 s
    # of CPU at start and are never used by the tracking API the test reads (measured: 10.2 -> 5.8 s
    # of CPU until /health answers, then 19.9 -> 0.1 s in the next 40 s, docs/test-timing.md).
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen(
        [str(server_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", "sqlite:///%s" % (root / "mlflow.db"), "--artifacts-destination", str(root / "artifacts")],
        stdout=(root / "server.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield server, "http://127.0.0.1:%d" % port, root / "server.log"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def mlflow_server(mlflow_process) -> str:
    """The URL of ``mlflow_process``'s server once it answers ``/health``."""
    import urllib.request

    server, url, log = mlflow_process
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return url
        except OSError:
            assert time.monotonic() < deadline, "mlflow server did not come up:\n" + log.read_text()[-3000:]
            time.sleep(0.5)


def test_mlflow_gets_one_run_per_try_from_the_driver_and_an_unreachable_server_only_warns(airflow, mlflow_server):
    from mlflow.tracking import MlflowClient

    from tests.integration.deployment import free_port

    env = {"AIRFLOW_CONN_MLFLOW_TEST": json.dumps({"conn_type": "http", "host": mlflow_server}),
           "AIRFLOW_CONN_MLFLOW_DEAD": json.dumps({"conn_type": "http", "host": "http://127.0.0.1:%d" % free_port(),
                                                   "password": "not-for-the-ranks"})}
    proc = airflow.dags_test("hvd_test_mlflow", env=env)
    assert proc.returncode == 0, explain(proc)
    assert airflow.task_states("hvd_test_mlflow") == {"tracked": ("success", 1), "unreachable": ("success", 1)}
    output = proc.stdout + proc.stderr
    assert "MLflow (connection 'mlflow_dead') cannot be reached; training goes on without it" in output
    assert airflow.xcom("hvd_test_mlflow", "unreachable", "horovod_metrics")["step"] == 30

    client = MlflowClient(tracking_uri=mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("hvd_test_mlflow").experiment_id])
    run_id = airflow.last_run_id("hvd_test_mlflow")
    assert {k: run.data.tags[k] for k in ("dag_id", "run_id", "task_id", "map_index", "try")} == {
        "dag_id": "hvd_test_mlflow", "run_id": run_id, "task_id": "tracked", "map_index": "-1", "try": "1"}
    assert run.data.params == {"np": "-2", "launcher": "gloo", "lr": "0.1", "epochs": "3"}  # scalar op_kwargs only
    assert (run.data.tags["horovod.attempts"], run.data.tags["horovod.attempt.0"]) == ("1", "success")
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    steps = [m.step for m in history]
    assert steps == sorted(steps) and steps[-1] == 30 and 2 <= len(steps) < 30  # kept reports, coalesced
    assert history[-1].value == pytest.approx(1 / 30)
    assert {m.value for m in client.get_metric_history(run.info.run_id, "rank_seen")} == {0.0}  # rank 0's only
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"checkpoint", "timeline"}, artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")] == ["checkpoint/model.txt"]
    link = airflow.xcom("hvd_test_mlflow", "tracked", "horovod_mlflow_url")
    assert link == "%s/#/experiments/%s/runs/%s" % (mlflow_server, run.info.experiment_id, run.info.run_id)
