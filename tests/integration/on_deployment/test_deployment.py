"""The provider on a real Airflow deployment, driven only through the REST API, as the UI does.

One deployment for this package's tests (``airflow_deployment``: PostgreSQL, API server, scheduler, DAG
processor, triggerer, LocalExecutor); each task runs an embedded ``local[2]`` Spark with real
Horovod ranks and mpirun or Gloo. Each test asserts what a user would look at: task states and
tries, XComs, the task log, the stored artifacts, and that no rank, ``orted`` or ``mpirun`` is left.

The tests run in file order: the clear test reruns the example run of the first test.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import pytest

from tests.conftest import run_processes
from tests.integration.browser import BROWSER_WAIT_S, save_screenshot
from tests.integration.deployment import Api, Deployment

pytestmark = pytest.mark.slow

METADATA = ("artifacts_uri", "checkpoint_uri", "timeline_uri", "try_number", "duration_s")
WARM_MODULE = "airflow_provider_horovod.runner.rank.warm"
GONE_WITHIN_S = 10  # no rank, orted or mpirun of a stopped task is left after this long


def local(uri: str) -> Path:
    assert uri.startswith("file://"), uri
    return Path(uri[len("file://"):])


def marker(folder: Any) -> dict:
    """A try's final marker; ``folder``: a local ``Path`` or an ``ObjectStoragePath``."""
    return json.loads((folder / "_ARTIFACTS.json").read_text())


def metadata(api: Api, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict:
    return {name: api.xcom(dag_id, run_id, task_id, "horovod_" + name, map_index) for name in METADATA}


def task_processes(dag_id: str, task_id: str | None = None, try_number: int | None = None) -> list[psutil.Process]:
    """This session's rank processes, orted and mpirun started for one task (by their Airflow context)."""
    found = []
    for proc in run_processes():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("AIRFLOW_CTX_DAG_ID") != dag_id:
            continue
        if task_id is not None and env.get("AIRFLOW_CTX_TASK_ID") != task_id:
            continue
        if try_number is not None and env.get("AIRFLOW_CTX_TRY_NUMBER") != str(try_number):
            continue
        found.append(proc)
    return found


def wait_gone(dag_id: str, task_id: str | None = None, try_number: int | None = None, timeout: float = GONE_WITHIN_S) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := task_processes(dag_id, task_id, try_number)) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = []
    for proc in left:
        try:
            out.append("%d %s" % (proc.pid, " ".join(proc.cmdline())[:200]))
        except psutil.Error:
            pass
    return out


def wait_log(api: Api, dag_id: str, run_id: str, task_id: str, try_number: int, text: str, timeout: float = 240) -> None:
    """Wait until the running try's log (read through the API, as the UI does) shows ``text``."""
    deadline = time.monotonic() + timeout
    while True:
        ti = api.task_instance(dag_id, run_id, task_id)
        log = api.log(dag_id, run_id, task_id, try_number) if ti["try_number"] >= try_number else ""
        if text in log:
            return
        assert ti["state"] in ("scheduled", "queued", "running", "up_for_retry", "restarting", None), \
            "%s.%s ended %s before logging %r:\n%s" % (dag_id, task_id, ti["state"], text, log[-4000:])
        assert time.monotonic() < deadline, "no %r in %s.%s try %d:\n%s" % (text, dag_id, task_id, try_number, log[-4000:])
        time.sleep(1)


def assert_clean_log(events: list[dict], what: str) -> None:
    """No error in a log that ended well, Spark's output at its own level, a summary at the end."""
    errors = [e for e in events if e.get("level") in ("error", "critical")]
    assert errors == [], "%s: error lines in the task log: %s" % (what, errors[:5])
    text = "\n".join(str(e.get("event")) for e in events)
    assert "XCom not found" not in text
    spark = [e for e in events if e.get("logger") == "airflow_provider_horovod.spark"]
    assert spark, "%s: no Spark/JVM line came through the provider's logger" % what
    assert all(e["level"] == ("warning" if " WARN " in e["event"] else e["level"]) for e in spark)
    assert "[rank 0] epoch 8: loss" in text  # rank lines, tagged
    assert "Horovod summary: succeeded; 2 ranks with mpirun" in text


def test_scheduled_example_trains_by_itself_and_the_asset_event_triggers_the_retrain(airflow_deployment: Deployment):
    api = airflow_deployment.api
    api.wait_dags(["horovod_digits_train", "horovod_digits_retrain", "hvd_deploy_stop", "hvd_deploy_crash",
                   "hvd_deploy_many"])
    run_id = api.wait_first_run("horovod_digits_train")  # nobody triggered it: the @daily schedule did
    assert api.run("horovod_digits_train", run_id)["run_type"] == "scheduled"
    assert api.wait_run("horovod_digits_train", run_id, timeout=420) == "success"

    summary = api.xcom("horovod_digits_train", run_id, "train")  # @task.horovod: the function's value
    assert set(summary) == {"epochs", "loss", "ranks"} and (summary["epochs"], summary["ranks"]) == (8, 2)
    trained = metadata(api, "horovod_digits_train", run_id, "train")
    assert trained["try_number"] == 1 and trained["duration_s"] > 0
    store = local(trained["artifacts_uri"])
    assert store == airflow_deployment.artifact_folder("horovod_digits_train", run_id, "train", 1)
    assert marker(store)["status"] == "success"
    assert (local(trained["checkpoint_uri"]) / "model.pt").stat().st_size > 0
    assert api.xcom("horovod_digits_train", run_id, "evaluate")["accuracy"] >= 0.90
    assert_clean_log(api.log_events("horovod_digits_train", run_id, "train", 1), "train")

    retrain_run = api.wait_first_run("horovod_digits_retrain")
    assert api.run("horovod_digits_retrain", retrain_run)["run_type"] == "asset_triggered"
    assert api.wait_run("horovod_digits_retrain", retrain_run, timeout=420) == "success"
    (event,) = api.asset_events("horovod_digits_model")
    assert event["extra"]["checkpoint_uri"] == trained["checkpoint_uri"]
    assert event["extra"]["result"] == summary
    assert api.xcom("horovod_digits_retrain", retrain_run, "latest_checkpoint") == trained["checkpoint_uri"]
    tuned = api.xcom("horovod_digits_retrain", retrain_run, "fine_tune")  # the operator: the documented dict
    assert (tuned["result"]["fine_tuned_from_epoch"], tuned["result"]["epochs"]) == (8, 10)
    assert "Resuming from checkpoint %s" % trained["checkpoint_uri"] in api.log("horovod_digits_retrain", retrain_run, "fine_tune", 1)
    api.pause("horovod_digits_retrain")  # the clear below publishes again; this test has seen the retrain


def test_clear_in_the_ui_reruns_a_task_with_resume_on_clear_from_its_newest_checkpoint(airflow_deployment: Deployment):
    api = airflow_deployment.api
    run_id = api.runs("horovod_digits_train")[0]["dag_run_id"]
    first = metadata(api, "horovod_digits_train", run_id, "train")
    api.clear("horovod_digits_train", run_id, ["train"])
    api.wait_task("horovod_digits_train", run_id, "train", ["success", "failed"], timeout=420, try_number=2)
    assert api.task_instance("horovod_digits_train", run_id, "train")["state"] == "success"

    assert api.xcom("horovod_digits_train", run_id, "train")["epochs"] == 16  # 8 resumed + 8 more
    second = metadata(api, "horovod_digits_train", run_id, "train")
    assert second["try_number"] == 2
    assert local(second["artifacts_uri"]).name == "try-2" and local(first["artifacts_uri"]).name == "try-1"
    assert marker(local(first["artifacts_uri"]))["status"] == "success"  # the earlier try is never touched
    log = api.log("horovod_digits_train", run_id, "train", 2)
    assert "Resuming from checkpoint %s" % first["checkpoint_uri"] in log
    assert "rank 0 resumes after epoch 8" in log
    assert "resumed from %s" % first["checkpoint_uri"] in log  # the summary says it too


def test_mark_failed_and_execution_timeout_store_rank_0s_checkpoint_as_cancelled(airflow_deployment: Deployment,
                                                                                browser, tmp_path):
    api = airflow_deployment.api
    dag_id = "hvd_deploy_stop"
    run_id = api.trigger(dag_id)
    wait_log(api, dag_id, run_id, "until_marked_failed", 1, "checkpoint 3 written")
    assert task_processes(dag_id, "until_marked_failed"), "the ranks of until_marked_failed are not running"
    watch_the_live_view(airflow_deployment, browser, tmp_path, dag_id, run_id, "until_marked_failed")
    marked = time.monotonic()
    api.mark(dag_id, run_id, "until_marked_failed", "failed")
    assert wait_gone(dag_id, "until_marked_failed") == []
    took = time.monotonic() - marked
    assert took <= GONE_WITHIN_S

    stopped = airflow_deployment.artifact_folder(dag_id, run_id, "until_marked_failed", 1)
    deadline = time.monotonic() + 30
    while not (stopped / "_ARTIFACTS.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = api.log(dag_id, run_id, "until_marked_failed", 1)
    assert "Cancelling the Horovod job" in log
    if (stopped / "_ARTIFACTS.json").exists():  # the cancel ended within Airflow's grace: the try says so itself
        assert marker(stopped)["status"] == "cancelled"
        assert (stopped / "checkpoints" / "step.txt").read_text() == "3"
    else:
        # Airflow's task supervisor sends SIGKILL 5 s after its SIGTERM (`kill(SIGTERM, force=True)`, a fixed
        # escalation delay); on 2 loaded cores the cancel (ranks stopped, rank 0's hand-over) can take longer
        # (seen once in three CI runs). Then the try is a killed one: no final marker, and rank 0's checkpoint
        # is the version committed while it trained, which a retry resumes from.
        assert "Task killed!" in log, log[-3000:]
        versions = sorted(stopped.glob("versions/*/_VERSION.json"))
        assert versions, "the killed try committed no version: rank 0's checkpoint 3 is lost"
        assert (versions[-1].parent / "step.txt").read_text() == "3"
        assert not list(stopped.glob("**/*.partial"))
    assert api.task_instance(dag_id, run_id, "until_marked_failed")["state"] == "failed"

    # execution_timeout: a try is cancelled (its checkpoint stored), the next try resumes from it. Try 1 is that
    # try unless a slow start let the timeout cut it off before its checkpoint; then try 2 checkpoints again.
    ti = api.wait_task(dag_id, run_id, "until_timeout", ["success", "failed"], timeout=600)
    final = ti["try_number"]
    tries = {n: api.log(dag_id, run_id, "until_timeout", n) for n in range(1, final + 1)}
    assert ti["state"] == "success" and final in (2, 3), "until_timeout ended %s after %d tries:\n%s" % (
        ti["state"], final, "\n".join(text[-2000:] for text in tries.values()))
    assert api.xcom(dag_id, run_id, "until_timeout") == {"resumed_step": 7}
    assert all("Process timed out" in tries[n] for n in range(1, final))
    timed_out = airflow_deployment.artifact_folder(dag_id, run_id, "until_timeout", final - 1)
    assert marker(timed_out)["status"] == "cancelled"
    assert (timed_out / "checkpoints" / "step.txt").read_text() == "7"
    assert "Horovod summary: cancelled" in tries[final - 1]
    assert "Resuming from checkpoint file://%s" % (timed_out / "checkpoints") in tries[final]
    assert wait_gone(dag_id) == []


@pytest.mark.parametrize("where", ["file", "s3"])
def test_sigkill_of_the_task_process_and_a_failing_function_resume_from_the_newest_committed_checkpoint(
    airflow_deployment: Deployment, where: str,
):
    """On ``file://`` (the deployment's artifact root): try 1 raises after its checkpoint, try 2 resumes
    from it and is SIGKILLed, try 3 resumes from the killed try's version, a Clear starts try 4 from
    scratch. On ``s3://`` (the task's own ``artifact_root`` in a bucket of the session's S3 server) only
    the SIGKILL and the resume, to spare the suite's time: try 1 is killed, try 2 resumes from it (the
    failing function and the Clear do not depend on the store). What is stored is read through the
    store's own reading code and through the Horovod view of the API server, on either root."""
    from airflow_provider_horovod import store

    api = airflow_deployment.api
    dag_id = "hvd_deploy_crash"
    api.wait_dags([dag_id])  # parsed already when the whole file runs; this test also runs alone
    root = airflow_deployment.s3_root if where == "s3" else None
    fail_first = where == "file"
    run_id = api.trigger(dag_id, conf={"artifact_root": root or "", "fail_first": fail_first})
    killed_try = 2 if fail_first else 1
    wait_log(api, dag_id, run_id, "crash", killed_try, "checkpoint %d written" % killed_try, timeout=420)

    if fail_first:  # try 1: the function raises after rank 0's checkpoint: failed, traceback in the log, checkpoint stored
        failed = airflow_deployment.stored_try(dag_id, run_id, "crash", 1)
        assert marker(failed)["status"] == "failed"
        assert (failed / "checkpoints" / "step.txt").read_text() == "1"
        first_log = api.log(dag_id, run_id, "crash", 1)
        assert "RuntimeError: planned failure after checkpoint 1" in first_log and "Traceback" in first_log

    # the killed try (on file://, try 2 resumed from try 1) committed its checkpoint as a version while
    # training: SIGKILL its task process, as a worker crash would
    killed_folder = airflow_deployment.stored_try(dag_id, run_id, "crash", killed_try, root=root)
    assert str(killed_folder).startswith(where + "://")
    deadline = time.monotonic() + 60
    while not store.versions(killed_folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    [(version, committed)] = store.versions(killed_folder)
    assert (committed / "step.txt").read_text() == str(killed_try)
    task_process = next(p.parent() for p in psutil.process_iter(["name"]) if p.info["name"] == "java"
                        and _ctx(p) == (dag_id, "crash", str(killed_try)))
    killed = time.monotonic()
    os.kill(task_process.pid, signal.SIGKILL)
    assert wait_gone(dag_id, "crash", killed_try) == []  # the JVM sees its stdin close; the ranks' watchdogs see the task go
    assert time.monotonic() - killed <= GONE_WITHIN_S

    # the next try resumes from the newest version committed before the kill (on file://: the killed try 2's, not try 1's)
    resumed = killed_try + 1
    api.wait_task(dag_id, run_id, "crash", ["success", "failed"], timeout=420, try_number=resumed)
    assert api.task_instance(dag_id, run_id, "crash")["state"] == "success"
    assert api.xcom(dag_id, run_id, "crash") == {"resumed_step": killed_try}
    assert api.xcom(dag_id, run_id, "crash", "horovod_artifacts_uri") == str(
        airflow_deployment.stored_try(dag_id, run_id, "crash", resumed, root=root))
    assert not (killed_folder / "_ARTIFACTS.json").exists()  # the killed try never ended, its version is there
    assert "Resuming from checkpoint %s (try %d, version %d)" % (committed, killed_try, version.seq) in api.log(
        dag_id, run_id, "crash", resumed)
    # the Horovod view (the API server reads the same store) shows the killed try's version and the resume
    tries = api.client.get(view_url(airflow_deployment, dag_id, run_id, "crash") + "/tries").raise_for_status().json()["tries"]
    assert [t["try_number"] for t in tries] == list(range(1, resumed + 1))
    assert tries[killed_try - 1]["artifacts_uri"] == str(killed_folder)
    assert [v["seq"] for v in tries[killed_try - 1]["versions"]] == [version.seq]
    assert (tries[-1]["status"], tries[-1]["resumed_from"]) == ("success", str(committed))
    assert wait_gone(dag_id) == []
    if not fail_first:
        return

    # a Clear starts from scratch (resume_on_clear=False, the default), as Airflow means it, although the
    # state store (kept by a Clear on Airflow 3.3) and the store both hold try 3's checkpoint. The Clear
    # waits for the scheduler to end the run: the task's success shows before that, and a Clear of a run
    # still running does not requeue it (clear_task_instances requeues finished runs only), so the
    # scheduler ended it as successful with the cleared task never scheduled (seen 1 run in 3).
    api.wait_run(dag_id, run_id, timeout=60)
    api.clear(dag_id, run_id, ["crash"])
    api.wait_task(dag_id, run_id, "crash", ["success", "failed"], timeout=420, try_number=4)
    assert api.task_instance(dag_id, run_id, "crash")["state"] == "success"
    assert api.xcom(dag_id, run_id, "crash") == {"resumed_step": None}
    log = api.log(dag_id, run_id, "crash", 4)
    assert "Try 4 follows a Clear of the task: starting from scratch (resume_on_clear=False)" in log
    assert "Resuming from checkpoint" not in log


def view_url(deployment: Deployment, dag_id: str, run_id: str, task_id: str) -> str:
    """The Horovod view of one task instance, as the browser opens it."""
    return "%s/horovod/dags/%s/runs/%s/tasks/%s" % (deployment.base_url, dag_id, quote(run_id, safe=""), task_id)


def watch_the_live_view(deployment: Deployment, browser, tmp_path: Path, dag_id: str, run_id: str, task_id: str) -> None:
    """While the try runs (it reports a step every 0.5 s): its metrics are in the store (``metrics/<n>.jsonl``),
    its log has progress lines, and the Horovod view shows it running and the step advancing without a reload."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    live = deployment.artifact_folder(dag_id, run_id, task_id, 1) / "metrics"
    wait_until(lambda: live.is_dir() and any(live.iterdir()), 30, "no metrics committed while %s runs" % task_id)
    wait_log(deployment.api, dag_id, run_id, task_id, 1, "Horovod progress: step ", timeout=30)
    browser.get(view_url(deployment, dag_id, run_id, task_id))
    wait = WebDriverWait(browser, BROWSER_WAIT_S)

    def step() -> int:
        shown = browser.find_element(By.ID, "progress-step").text  # "step 12/100000 (0%)"
        return int(shown.split()[1].split("/")[0]) if shown.startswith("step ") else -1

    first = wait.until(lambda d: step() >= 0 and step())
    assert browser.find_element(By.ID, "status").text == "running"
    assert browser.find_element(By.ID, "progress-status").text == "try 1: running"
    save_screenshot(browser, tmp_path, "horovod-view-live-1.png")
    browser.execute_script("window.notReloaded = true")
    later = wait.until(lambda d: step() >= first + 4 and step())  # the page fetched again by itself: 2 steps/s
    assert browser.execute_script("return window.notReloaded") is True
    assert browser.find_element(By.ID, "progress-rate").text not in ("", "–")
    assert browser.find_element(By.ID, "progress-eta").text not in ("", "–")
    assert {e.get_attribute("data-metric") for e in browser.find_elements(By.CSS_SELECTOR, "svg.chart")} == {"loss", "acc"}
    assert browser.find_elements(By.CSS_SELECTOR, "svg.chart[data-metric=loss] polyline[data-try='1']")
    assert float(browser.find_element(By.CSS_SELECTOR, "#newest-metrics tr[data-metric=loss] td.metric-value").text) \
        == pytest.approx(1.0 / (1 + 0.1 * later), rel=0.05)
    assert save_screenshot(browser, tmp_path, "horovod-view-live.png").stat().st_size > 20_000


def shared_cluster_ranks() -> list[psutil.Process]:
    """This session's rank processes on the shared cluster's executors (no Airflow context: they are
    not the task's children)."""
    return [p for p in run_processes() if _ctx(p)[0] is None]


def lineage(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s ancestors, from a forked rank's warm process on through its owner (the executor's
    pyspark daemon): the warm process outlives the Python worker that started it, then init is its parent."""
    found: list[psutil.Process] = []
    parent = proc.parent()
    while parent is not None and parent.pid > 1:
        found.append(parent)
        cmdline = parent.cmdline()
        if WARM_MODULE in cmdline:  # python -m ...rank.warm FD SOCKET OWNER MODULE...
            parent = psutil.Process(int(cmdline[cmdline.index(WARM_MODULE) + 3]))
        else:
            parent = parent.parent()
    return found


def newest_step(folder: Path) -> int:
    """The step of the newest version committed in a try folder (0 before the first)."""
    versions = sorted(folder.glob("versions/*/_VERSION.json"), key=lambda m: int(m.parent.name))
    return int((versions[-1].parent / "step.txt").read_text()) if versions else 0


def test_an_executor_killed_mid_training_restarts_in_the_same_try_and_the_view_shows_both_attempts(
        airflow_deployment: Deployment, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    api = airflow_deployment.api
    dag_id = "hvd_deploy_restart"
    api.wait_dags([dag_id])
    run_id = api.trigger(dag_id)
    folder = airflow_deployment.artifact_folder(dag_id, run_id, "survive", 1)
    wait_until(lambda: newest_step(folder) >= 3, 180, "survive committed no version with step 3")
    # the ranks run on the shared cluster's executors, outside the task's process tree: rank 1 names its JVM
    wait_log(api, dag_id, run_id, "survive", 1, "rank 1 runs in the executor JVM ")
    jvm = int(api.log(dag_id, run_id, "survive", 1).split("rank 1 runs in the executor JVM ")[1].split()[0])
    executor = psutil.Process(jvm)
    assert "CoarseGrainedExecutorBackend" in " ".join(executor.cmdline())
    ranks = [p for p in shared_cluster_ranks() if executor in lineage(p)]
    assert ranks, "no rank process under the executor JVM %d" % jvm
    killed_after = newest_step(folder)
    executor.kill()

    ti = api.wait_task(dag_id, run_id, "survive", ["success", "failed"], timeout=300)
    log = api.log(dag_id, run_id, "survive", 1)
    assert (ti["state"], ti["try_number"]) == ("success", 1), log[-3000:]  # no Airflow retry: the same try
    result = api.xcom(dag_id, run_id, "survive")
    assert result["attempt"] == 1 and result["size"] == 2 and result["resumed_step"] >= killed_after
    attempts = api.xcom(dag_id, run_id, "survive", "horovod_attempts")
    assert [a["ending"] for a in attempts] == ["lost", "success"], attempts
    assert attempts[1]["resumed_from"]["step"] == result["resumed_step"]
    assert "Attempt 1 of run" in log
    deadline = time.monotonic() + GONE_WITHIN_S
    while shared_cluster_ranks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shared_cluster_ranks() == []

    browser.get(view_url(airflow_deployment, dag_id, run_id, "survive"))
    rows = WebDriverWait(browser, BROWSER_WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#attempts tr td:first-child"))
    assert [r.text for r in rows] == ["0", "1"]
    assert "version" in browser.find_element(By.ID, "attempts").text


def wait_until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _ctx(proc: psutil.Process) -> tuple[str | None, str | None, str | None]:
    try:
        env = proc.environ()
    except psutil.Error:
        return (None, None, None)
    return env.get("AIRFLOW_CTX_DAG_ID"), env.get("AIRFLOW_CTX_TASK_ID"), env.get("AIRFLOW_CTX_TRY_NUMBER")


def test_the_default_retry_policy_fails_a_raising_function_and_too_few_slots_on_a_local_master_after_one_try(
        airflow_deployment: Deployment, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    api = airflow_deployment.api
    dag_id = "hvd_deploy_retry_policy"
    api.wait_dags([dag_id])
    run_id = api.trigger(dag_id)
    assert api.wait_run(dag_id, run_id, timeout=300) == "failed"
    raises = api.task_instance(dag_id, run_id, "raises")
    slots = api.task_instance(dag_id, run_id, "more_ranks_than_slots")
    assert (raises["state"], raises["try_number"]) == ("failed", 1)  # although retries=2
    assert (slots["state"], slots["try_number"]) == ("failed", 1)  # although retries=1: a local master cannot grow
    log = api.log(dag_id, run_id, "raises", 1)
    assert ("Not retried (user code): the training function raised ValueError: the learning rate must be positive "
            "in rank ") in log, log[-3000:]
    log = api.log(dag_id, run_id, "more_ranks_than_slots", 1)
    # the operator's start_timeout reaches the engine; a local master fails without waiting for it
    assert "no executor can join a local master: waiting start_timeout=2s would not help" in log, log[-3000:]
    assert ("Not retried (no retry fixes it): the cluster's barrier slots cannot grow (FixedSlotsError: np=4 needs 4 "
            "barrier slots, but the cluster has 2") in log, log[-3000:]
    wait = WebDriverWait(browser, BROWSER_WAIT_S)
    for task_id, why in [("raises", "Not retried (user code): the training function raised ValueError"),
                         ("more_ranks_than_slots", "Not retried (no retry fixes it): the cluster's barrier slots cannot grow")]:
        browser.get(view_url(airflow_deployment, dag_id, run_id, task_id))
        shown = wait.until(lambda d: d.find_elements(By.ID, "failure-retry"))
        assert shown[0].text.startswith(why), shown[0].text


def test_two_runs_at_once_and_a_mapped_task_on_one_spark_cluster_keep_their_artifacts_apart(airflow_deployment: Deployment):
    api = airflow_deployment.api
    dag_id = "hvd_deploy_many"
    api.wait_dags([dag_id])  # parsed already when the whole file runs; this test also runs alone
    runs = [api.trigger(dag_id), api.trigger(dag_id)]
    for run_id in runs:
        assert api.wait_run(dag_id, run_id, timeout=600) == "success"
    folders = set()
    for run_id in runs:
        for index, lr in enumerate([0.1, 0.2]):
            assert api.xcom(dag_id, run_id, "fit", map_index=index) == {"tag": run_id, "lr": lr, "ranks": 2}
            meta = metadata(api, dag_id, run_id, "fit", index)
            folder = local(meta["artifacts_uri"])
            assert folder == airflow_deployment.artifact_folder(dag_id, run_id, "fit", 1, map_index=index)
            assert (local(meta["checkpoint_uri"]) / "owner.txt").read_text() == "%s lr=%s" % (run_id, lr)
            folders.add(folder)
    assert len(folders) == 4
    assert wait_gone(dag_id) == []
    # all four ran as applications of the one shared cluster, two of them at the same time
    apps = [a for a in airflow_deployment.shared_spark.applications() if a["name"] == "%s.fit" % dag_id]
    assert len(apps) == 4, apps
    spans = sorted((a["starttime"], a["starttime"] + a["duration"]) for a in apps)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans
