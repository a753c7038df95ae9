"""The Horovod view on a real deployment: what it shows for a finished and a failed try, who may
see it, and that no request reads outside a try's artifact folder.

One run of ``deployment_dags/hvd_view.py`` (``trained`` succeeds, ``fails`` fails on rank 1), made by
the real scheduler; every request goes to the real API server, with the admin's token, a user the
auth manager gives no DAG access, or no credentials at all.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.integration.browser import BROWSER_WAIT_S, save_screenshot
from tests.integration.on_deployment.conftest import NO_DAG_ACCESS_USER, PATH_PREFIX
from tests.integration.deployment import Deployment

pytestmark = [pytest.mark.slow]

DAG = "hvd_view"
SVG = "{http://www.w3.org/2000/svg}"


class ViewRun:
    """The finished run of ``hvd_view`` and a client for the view's URLs."""

    def __init__(self, deployment: Deployment, run_id: str) -> None:
        self.deployment = deployment
        self.run_id = run_id
        self.http = httpx.Client(base_url=deployment.base_url, timeout=60)

    def url(self, task_id: str, tail: str = "", dag_id: str = DAG, run_id: str | None = None) -> str:
        run = quote(run_id if run_id is not None else self.run_id, safe="")
        return "/horovod/dags/%s/runs/%s/tasks/%s%s" % (dag_id, run, task_id, tail)

    def get(self, path: str, token: str | None = "admin", **kwargs: object) -> httpx.Response:
        headers = {}
        if token == "admin":
            headers["Authorization"] = "Bearer %s" % self.deployment.api.token
        elif token:
            headers["Authorization"] = "Bearer %s" % token
        return self.http.get(path, headers=headers, **kwargs)

    def folder(self, task_id: str, try_number: int = 1) -> Path:
        return self.deployment.artifact_folder(DAG, self.run_id, task_id, try_number)


@pytest.fixture(scope="module")
def view_run(airflow_deployment: Deployment) -> ViewRun:
    api = airflow_deployment.api
    api.wait_dags([DAG])
    run_id = api.trigger(DAG)
    api.wait_run(DAG, run_id, timeout=300)
    states = {ti["task_id"]: ti["state"] for ti in api.task_instances(DAG, run_id)}
    assert states == {"trained": "success", "fails": "failed", "stalls": "failed"}, states
    run = ViewRun(airflow_deployment, run_id)
    yield run
    run.http.close()


def test_a_finished_try_shows_its_facts_timeline_and_checkpoints(view_run):
    tries = view_run.get(view_run.url("trained", "/tries")).json()["tries"]
    assert len(tries) == 1
    facts = tries[0]
    assert (facts["try_number"], facts["status"], facts["np"], facts["launcher"]) == (1, "success", -2, "gloo")
    assert facts["duration_s"] > 0 and facts["resumed_from"] is None and facts["error"] is None
    assert facts["artifacts_uri"] == "file://%s" % view_run.folder("trained")
    on_disk = view_run.folder("trained") / "checkpoints" / "model.pt"
    assert {(c["path"], c["size"]) for c in facts["checkpoints"]} == {
        ("checkpoints/model.pt", on_disk.stat().st_size), ("checkpoints/epoch.txt", 1)}
    assert facts["timeline"] is True

    page = view_run.get(view_run.url("trained"))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for text in ("try 1 · success", "gloo", "model.pt", "293.0 KiB", "Download timeline.json", str(view_run.folder("trained"))):
        assert text in page.text


def test_checkpoint_and_timeline_download_as_stored(view_run):
    folder = view_run.folder("trained")
    model = view_run.get(view_run.url("trained", "/tries/1/files/checkpoints/model.pt"))
    assert model.status_code == 200
    assert model.content == (folder / "checkpoints" / "model.pt").read_bytes()
    assert "attachment" in model.headers["content-disposition"] and "model.pt" in model.headers["content-disposition"]
    trace = view_run.get(view_run.url("trained", "/tries/1/files/timeline.json"))
    assert trace.status_code == 200 and json.loads(trace.content) == json.loads((folder / "timeline.json").read_text())


def test_the_timeline_picture_shows_each_tensor_over_time_without_rank_rows(view_run):
    reply = view_run.get(view_run.url("trained", "/tries/1/timeline.svg"))
    assert reply.status_code == 200 and reply.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(reply.text)
    labels = {"".join(t.itertext()).strip() for t in root.iter(SVG + "text")}
    assert {"allreduce.layer1.weight", "allreduce.layer1.bias", "allreduce.layer2.weight"} <= labels
    assert "Time per operation" in labels and "time since the first event" in labels
    assert not labels & {"0", "1"}  # rank-ready markers are ticks, not operations
    ticks = ["".join(line.itertext()) for line in root.iter(SVG + "line") if "ready" in "".join(line.itertext())]
    # each tensor is negotiated at least once (later steps may hit Horovod's response cache), both ranks ready
    assert len(ticks) >= 3 * 2 and {t.split(" ready")[0] for t in ticks} == {"rank 0", "rank 1"}


def test_a_failed_try_shows_the_failing_ranks_error_and_last_lines(view_run):
    facts = view_run.get(view_run.url("fails", "/tries")).json()["tries"][0]
    assert facts["status"] == "failed"
    error = facts["error"]
    assert error["rank"] == 1 and error["exception"] == "FloatingPointError: loss diverged at step 3 (nan)"
    assert "about to fail: the loss is nan" in error["tail"]
    page = view_run.get(view_run.url("fails")).text
    assert "Failure of rank 1" in page and "about to fail: the loss is nan" in page and "Traceback" in page
    assert view_run.get(view_run.url("fails", "/tries/1/timeline.svg")).status_code == 200  # valid though it failed


def test_extra_links_open_the_view_and_no_dead_spark_ui(view_run):
    api = view_run.deployment.api
    links = api.get("/dags/%s/dagRuns/%s/taskInstances/trained/links" % (DAG, quote(view_run.run_id, safe="")))["extra_links"]
    assert links["Horovod timeline"] == "%s/dags/%s/runs/%s/tasks/trained/plugin/horovod" % (
        view_run.deployment.base_url, DAG, quote(view_run.run_id, safe=""))
    assert links["Spark UI"] is None  # no History Server named, so no link rather than a dead :4040
    plugins = {p["name"]: p for p in api.get("/plugins")["plugins"]}
    view = plugins["horovod"]["external_views"][0]
    assert (view["destination"], view["url_route"]) == ("task_instance", "horovod")
    assert view["href"].startswith(PATH_PREFIX + "/horovod/dags/{DAG_ID}/")  # under [api] base_url's path


ENDPOINTS = ["", "/tries", "/tries/1/timeline.svg", "/tries/1/files/checkpoints/model.pt"]


@pytest.mark.parametrize("tail", ENDPOINTS)
def test_anonymous_callers_get_401(view_run, tail):
    reply = view_run.get(view_run.url("trained", tail), token=None)
    assert reply.status_code == 401, reply.text
    assert b"model.pt" not in reply.content


@pytest.mark.parametrize("tail", ENDPOINTS)
def test_a_user_without_access_to_the_dag_gets_403(view_run, tail):
    password = json.loads((view_run.deployment.home / "passwords.json").read_text())[NO_DAG_ACCESS_USER]
    token = view_run.http.post("/auth/token", json={"username": NO_DAG_ACCESS_USER, "password": password}).json()["access_token"]
    assert view_run.get("/api/v2/dags/%s" % DAG, token=token).status_code == 403  # Airflow's own answer, too
    reply = view_run.get(view_run.url("trained", tail), token=token)
    assert reply.status_code == 403, reply.text


def test_a_forged_session_cookie_is_refused(view_run):
    reply = view_run.http.get(view_run.url("trained"), cookies={"_token": "not-a-jwt"})
    assert reply.status_code in (401, 403) and "model.pt" not in reply.text


@pytest.mark.parametrize("tail", [
    "/tries/1/files/../../../../../../etc/passwd",
    "/tries/1/files/..%2F..%2F..%2Ffails%2Ftry-1%2F_ARTIFACTS.json",
    "/tries/1/files/%2e%2e/%2e%2e/fails/try-1/timeline.json",
    "/tries/1/files//etc/passwd",
    "/tries/1/files/_ARTIFACTS.json",  # in the folder, but not a stored file
    "/tries/1/files/checkpoints",
    "/tries/0/timeline.svg",
    "/tries/2/files/timeline.json",
])
def test_paths_outside_the_stored_files_are_not_found(view_run, tail):
    reply = view_run.get(view_run.url("trained", tail))
    assert reply.status_code in (404, 422), (reply.status_code, reply.text)
    assert b"root:" not in reply.content and b"stored_files" not in reply.content


@pytest.mark.parametrize(("dag_id", "run_id", "task_id"), [
    (DAG, "..", "trained"),
    (DAG, ".", "trained"),
    ("..", "..", "trained"),
    (DAG, "a\\..\\..", "trained"),
])
def test_ids_that_are_not_one_path_component_are_bad_requests(view_run, dag_id, run_id, task_id):
    path = "/horovod/dags/%s/runs/%s/tasks/%s/tries" % (quote(dag_id, safe=""), quote(run_id, safe=""), task_id)
    assert view_run.get(path).status_code in (400, 403, 404)
    encoded = "/horovod/dags/%s/runs/%s/tasks/%s/tries" % (DAG, "..%2F..%2F" + quote(view_run.run_id, safe=""), task_id)
    assert view_run.get(encoded).status_code == 404  # %2F is a slash: no route matches


def test_symlinks_out_of_a_try_folder_are_not_followed(view_run):
    """Someone who can write the store plants links: a listed file and a whole try that point elsewhere."""
    secret = view_run.deployment.home / "passwords.json"
    task_folder = view_run.folder("trained").parent
    planted = task_folder / "try-7"
    (planted / "checkpoints").mkdir(parents=True)
    os.symlink(secret, planted / "checkpoints" / "model.pt")
    (planted / "_ARTIFACTS.json").write_text(json.dumps({"status": "success", "stored_files": ["checkpoints/model.pt"]}))
    elsewhere = view_run.deployment.root / "elsewhere"
    (elsewhere / "checkpoints").mkdir(parents=True)
    (elsewhere / "checkpoints" / "model.pt").write_bytes(secret.read_bytes())
    (elsewhere / "_ARTIFACTS.json").write_text(json.dumps({"status": "success", "stored_files": ["checkpoints/model.pt"]}))
    os.symlink(elsewhere, task_folder / "try-8")
    try:
        for try_number in (7, 8):
            reply = view_run.get(view_run.url("trained", "/tries/%d/files/checkpoints/model.pt" % try_number))
            assert reply.status_code == 404, (try_number, reply.status_code)
            assert b"admin" not in reply.content
        listed = view_run.get(view_run.url("trained", "/tries")).json()["tries"]
        assert [t["checkpoints"] for t in listed if t["try_number"] == 7] == [[]]
        assert 8 not in [t["try_number"] for t in listed]
    finally:
        (task_folder / "try-8").unlink()
        (planted / "checkpoints" / "model.pt").unlink()
        (planted / "_ARTIFACTS.json").unlink()
        (planted / "checkpoints").rmdir()
        planted.rmdir()


# -- in a real browser (the session's Chromium: tests/integration/browser.py) ---------------------------
@pytest.mark.parametrize("task_id", ["trained", "fails"])
def test_in_the_browser_the_horovod_timeline_link_opens_the_view(browser, view_run, task_id, tmp_path):
    from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # The UI is a React app that re-renders while its data arrives: an element found a moment ago
    # may be replaced (or covered) before it is read or clicked, so each wait retries then.
    wait = WebDriverWait(browser, BROWSER_WAIT_S,
                         ignored_exceptions=(StaleElementReferenceException, ElementClickInterceptedException))
    run = quote(view_run.run_id, safe="")
    browser.get("%s/dags/%s/runs/%s/tasks/%s/details" % (view_run.deployment.base_url, DAG, run, task_id))
    wait.until(lambda d: d.find_elements(By.XPATH, "//a[normalize-space()='Horovod timeline']"))
    assert browser.find_elements(By.XPATH, "//a[normalize-space()='Spark UI']") == []  # absent, not dead
    wait.until(lambda d: d.find_element(By.XPATH, "//a[normalize-space()='Horovod timeline']").click() or True)
    wait.until(lambda d: d.current_url.endswith("/tasks/%s/plugin/horovod" % task_id))
    frame = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "iframe[title=Horovod]"))[0]
    browser.switch_to.frame(frame)
    try:
        wait.until(lambda d: d.find_elements(By.ID, "status"))
        picture = wait.until(lambda d: d.execute_script(
            "var i = document.getElementById('timeline-picture');"
            "return i && i.complete && i.naturalWidth > 0 ? i : null;"))
        assert picture.is_displayed() and picture.size["width"] > 400
        files = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#files td code")]
        assert "timeline.json" in files
        if task_id == "trained":
            assert browser.find_element(By.ID, "status").text == "success"
            assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#checkpoints td code")] == ["epoch.txt", "model.pt"]
            next(a for a in browser.find_elements(By.CSS_SELECTOR, "#checkpoints a.download")
                 if a.get_attribute("href").endswith("/model.pt")).click()
            saved = browser.downloads / "model.pt"
            wait.until(lambda d: saved.exists() and saved.stat().st_size == 300_000)
            assert saved.read_bytes() == (view_run.folder("trained") / "checkpoints" / "model.pt").read_bytes()
        else:
            assert browser.find_element(By.ID, "status").text == "failed"
            assert "FloatingPointError: loss diverged at step 3 (nan)" in browser.find_element(By.ID, "failure-message").text
            assert "about to fail: the loss is nan" in browser.find_element(By.ID, "failure-tail").text
        browser.execute_script("window.scrollTo(0, 0)")
    finally:
        browser.switch_to.default_content()
    assert save_screenshot(browser, tmp_path, "horovod-view-%s.png" % task_id).stat().st_size > 20_000


def test_in_the_browser_a_stalled_try_shows_who_stalled_and_every_ranks_stacks(browser, view_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(view_run.deployment.base_url + view_run.url("stalls"))  # the view's own page, as the tab frames it
    WebDriverWait(browser, BROWSER_WAIT_S).until(lambda d: d.find_elements(By.ID, "failure-traceback"))
    assert browser.find_element(By.ID, "status").text == "failed"
    message = browser.find_element(By.ID, "failure-message").text
    assert message.startswith("stalled: rank 1 ") and "in user code at waits_for_a_lock_never_released" in message
    stacks = browser.find_element(By.ID, "failure-traceback").text
    assert stacks.startswith("Python stacks at the stall") and "in waits_for_a_lock_never_released" in stacks
    assert "rank 0 (pid" in stacks and "waits in allreduce" in stacks
    assert save_screenshot(browser, tmp_path, "horovod-view-stalls.png").stat().st_size > 20_000
