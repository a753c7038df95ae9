"""A real Airflow deployment for tests: PostgreSQL, API server, scheduler, DAG processor, triggerer.

Everything is throwaway and on free ports: a PostgreSQL 15 server (Debian's ``postgresql``
package, ``initdb`` + ``pg_ctl`` in a temporary folder) as the metadata database, and the four
Airflow 3 processes with the LocalExecutor in a temporary ``AIRFLOW_HOME``. Tests talk to it only
through the public REST API, as the UI does (:class:`Api`: a bearer token from ``/auth/token``).

Use it through the ``airflow_deployment`` fixture (``tests/integration/on_deployment/conftest.py``), or build
your own::

    with Deployment.start(tmp_path, dag_files=[...]) as airflow:
        run_id = airflow.api.trigger("my_dag")
        airflow.api.wait_run("my_dag", run_id)

Every process is started in its own session and stopped in ``close()`` (TERM, then KILL), even when
a test fails; the PostgreSQL server goes last.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.integration.cluster import free_port

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
ADMIN_USER = "admin"
STARTUP_TIMEOUT_S = 240
FINISHED = ("success", "failed")


class DeploymentError(RuntimeError):
    """The deployment could not start, or an API call did not give what the test needed."""


def write_private(path: Path, text: str) -> None:
    """``text`` into a new file only this user can read (0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL server programs (``initdb``, ``pg_ctl``, ``postgres``)."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    if not candidates:
        raise DeploymentError("PostgreSQL server programs are missing: run scripts/setup (it installs postgresql).")
    return candidates[0].parent


def _stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """TERM the process group of ``proc`` (and every descendant), then KILL what is left."""
    if proc.poll() is not None and not _descendants(proc.pid):
        return
    family = [proc.pid, *_descendants(proc.pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in family):
        time.sleep(0.2)
    family += _descendants(proc.pid)
    for pid in family:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _descendants(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Postgres:
    """A PostgreSQL server of its own in a private temporary folder, on a free port of 127.0.0.1,
    with a random password (SCRAM) for every connection: no other local user gets in."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.root = Path(tempfile.mkdtemp(prefix="hvd-pg-"))  # not under pytest's 0700 tmp: the server user must reach it
        self.data = self.root / "data"
        self.port = free_port()
        self.log = self.root / "server.log"
        self._user = "postgres" if os.geteuid() == 0 else None  # initdb refuses to run as root
        self.password = secrets.token_urlsafe(24)
        self.started = False

    @property
    def url(self) -> str:
        return "postgresql+psycopg2://postgres:%s@127.0.0.1:%d/airflow" % (self.password, self.port)

    def _as_server_user(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if self._user is not None:
            argv = ["runuser", "-u", self._user, "--", *argv]
        env = {**os.environ, "PGPASSWORD": self.password}
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, **kwargs)

    def start(self) -> None:
        password_file = self.root / "password"
        write_private(password_file, self.password)
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            for path in (self.root, password_file):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        done = self._as_server_user([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                                     "--auth=scram-sha-256", "--pwfile", str(password_file), "--no-sync", "-E", "UTF8"])
        password_file.unlink()
        if done.returncode != 0:
            raise DeploymentError("initdb failed:\n%s%s" % (done.stdout, done.stderr))
        options = "-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" % (self.port, self.root)
        done = self._as_server_user([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                                     "-w", "-t", "60", "start"])
        if done.returncode != 0:
            raise DeploymentError("pg_ctl start failed:\n%s%s\n%s" % (done.stdout, done.stderr, self._log_tail()))
        self.started = True
        done = self._as_server_user([str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c",
                                     "CREATE DATABASE airflow"])
        if done.returncode != 0:
            raise DeploymentError("Cannot create the airflow database:\n%s%s" % (done.stdout, done.stderr))

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text()[-3000:]
        return ""

    def stop(self) -> None:
        try:
            if self.started:
                self._as_server_user([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        finally:
            self.started = False
            shutil.rmtree(self.root, ignore_errors=True)


class Api:
    """The public REST API (``/api/v2``) with an admin's bearer token: what the UI does, as calls."""

    def __init__(self, base_url: str, password: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._password = password
        self.client = httpx.Client(base_url=self.base_url, timeout=60)
        self.token = self._login()

    def _login(self) -> str:
        reply = self.client.post("/auth/token", json={"username": ADMIN_USER, "password": self._password})
        if reply.status_code >= 300:
            raise DeploymentError("POST /auth/token -> %s %s" % (reply.status_code, reply.text[:500]))
        token = reply.json()["access_token"]
        self.client.headers["Authorization"] = "Bearer %s" % token
        return token

    def call(self, method: str, path: str, *, ok: Iterable[int] = (200, 201, 204), **kwargs: Any) -> Any:
        reply = self.client.request(method, "/api/v2" + path, **kwargs)
        if reply.status_code == 401:  # the token expired: log in again, once
            self._login()
            reply = self.client.request(method, "/api/v2" + path, **kwargs)
        if reply.status_code not in tuple(ok):
            raise DeploymentError("%s /api/v2%s -> %s %s" % (method, path, reply.status_code, reply.text[:1000]))
        if reply.status_code == 204 or not reply.content:
            return None
        return reply.json() if "json" in reply.headers.get("content-type", "") else reply.text

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.call("GET", path, **kwargs)

    # -- DAGs and runs ---------------------------------------------------------------------------
    def wait_dags(self, dag_ids: Iterable[str], timeout: float = 180) -> None:
        """Wait until the DAG processor has parsed every DAG of ``dag_ids``."""
        wanted = set(dag_ids)
        deadline = time.monotonic() + timeout
        while True:
            found = {d["dag_id"] for d in self.get("/dags", params={"limit": 1000})["dags"]}
            if wanted <= found:
                return
            if time.monotonic() > deadline:
                errors = self.get("/importErrors")
                raise DeploymentError("DAGs %s were not parsed within %ss; import errors: %s"
                                      % (sorted(wanted - found), timeout, json.dumps(errors)[:3000]))
            time.sleep(1)

    def pause(self, dag_id: str, paused: bool = True) -> None:
        self.call("PATCH", "/dags/%s" % dag_id, json={"is_paused": paused})

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.call("POST", "/dags/%s/dagRuns" % dag_id, json={"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.get("/dags/%s/dagRuns" % dag_id, params={"order_by": "run_after", "limit": 100})["dag_runs"]

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.get("/dags/%s/dagRuns/%s" % (dag_id, run_id))

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300, states: Iterable[str] = FINISHED) -> str:
        """Wait until the run is in one of ``states``; return that state."""
        return self._wait(lambda: self.run(dag_id, run_id)["state"], states, timeout, "%s/%s" % (dag_id, run_id))

    def wait_first_run(self, dag_id: str, timeout: float = 180) -> str:
        """Wait until ``dag_id`` has a run (one the scheduler made by itself, or an asset event's); its run id."""
        deadline = time.monotonic() + timeout
        while not (runs := self.runs(dag_id)):
            if time.monotonic() > deadline:
                raise DeploymentError("%s got no run within %ss" % (dag_id, timeout))
            time.sleep(1)
        return runs[0]["dag_run_id"]

    # -- task instances --------------------------------------------------------------------------
    def _ti_path(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
        path = "/dags/%s/dagRuns/%s/taskInstances/%s" % (dag_id, run_id, task_id)
        return path if map_index < 0 else "%s/%d" % (path, map_index)

    def task_instance(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        return self.get(self._ti_path(dag_id, run_id, task_id, map_index))

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.get("/dags/%s/dagRuns/%s/taskInstances" % (dag_id, run_id), params={"limit": 1000})["task_instances"]

    def wait_task(self, dag_id: str, run_id: str, task_id: str, states: Iterable[str], timeout: float = 300,
                  map_index: int = -1, try_number: int | None = None) -> dict[str, Any]:
        """Wait until the task instance (of ``try_number``, when given) is in one of ``states``."""
        states = tuple(states)
        deadline = time.monotonic() + timeout
        while True:
            ti = self.task_instance(dag_id, run_id, task_id, map_index)
            if ti["state"] in states and (try_number is None or ti["try_number"] == try_number):
                return ti
            if time.monotonic() > deadline:
                raise DeploymentError("%s/%s/%s stayed %s (try %s), not %s within %ss"
                                      % (dag_id, run_id, task_id, ti["state"], ti["try_number"], states, timeout))
            time.sleep(0.5)

    def clear(self, dag_id: str, run_id: str, task_ids: list[str], *, downstream: bool = False) -> None:
        """The UI's "Clear": the task instances start a new try."""
        self.call("POST", "/dags/%s/clearTaskInstances" % dag_id, json={
            "dry_run": False, "dag_run_id": run_id, "task_ids": task_ids, "only_failed": False,
            "include_downstream": downstream, "include_upstream": False, "reset_dag_runs": True,
        })

    def mark(self, dag_id: str, run_id: str, task_id: str, state: str, map_index: int = -1) -> None:
        """The UI's "Mark as success/failed" on one task instance."""
        self.call("PATCH", self._ti_path(dag_id, run_id, task_id, map_index), json={"new_state": state})

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        params = {"deserialize": "true"}
        if map_index >= 0:
            params["map_index"] = str(map_index)
        entry = self.get("/dags/%s/dagRuns/%s/taskInstances/%s/xcomEntries/%s" % (dag_id, run_id, task_id, key),
                         params=params)
        return entry["value"]

    def xcom_keys(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> set[str]:
        params: dict[str, Any] = {"limit": 1000}
        if map_index >= 0:
            params["map_index"] = map_index
        entries = self.get("/dags/%s/dagRuns/%s/taskInstances/%s/xcomEntries" % (dag_id, run_id, task_id), params=params)
        return {e["key"] for e in entries["xcom_entries"]}

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        """The task log of one try as the UI shows it, one line per event (``level`` and ``event``)."""
        params: dict[str, Any] = {"full_content": "true"}
        if map_index >= 0:
            params["map_index"] = map_index
        body = self.get("/dags/%s/dagRuns/%s/taskInstances/%s/logs/%d" % (dag_id, run_id, task_id, try_number),
                        params=params, headers={"Accept": "application/json"})
        lines = []
        for item in body.get("content", []) if isinstance(body, dict) else []:
            if isinstance(item, dict):
                lines.append("%s %s" % (item.get("level", ""), item.get("event", "")))
            else:
                lines.append(str(item))
        return "\n".join(lines)

    def log_events(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> list[dict]:
        """The structured log events of one try (each a dict with ``event``, ``level``, ``logger``, ...)."""
        params: dict[str, Any] = {"full_content": "true"}
        if map_index >= 0:
            params["map_index"] = map_index
        body = self.get("/dags/%s/dagRuns/%s/taskInstances/%s/logs/%d" % (dag_id, run_id, task_id, try_number),
                        params=params, headers={"Accept": "application/json"})
        return [item for item in body.get("content", []) if isinstance(item, dict)]

    def asset_events(self, asset_name: str) -> list[dict[str, Any]]:
        assets = self.get("/assets", params={"name_pattern": asset_name})["assets"]
        asset = next((a for a in assets if a["name"] == asset_name), None)
        if asset is None:
            return []
        return self.get("/assets/events", params={"asset_id": asset["id"], "order_by": "timestamp"})["asset_events"]

    @staticmethod
    def _wait(read, states: Iterable[str], timeout: float, what: str) -> str:
        states = tuple(states)
        deadline = time.monotonic() + timeout
        while True:
            state = read()
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise DeploymentError("%s stayed %s, not %s within %ss" % (what, state, states, timeout))
            time.sleep(1)


def task_env(artifacts: Path) -> dict[str, str]:
    """What an Airflow process running Horovod tasks needs here: the artifact root, Spark on
    127.0.0.1, and this virtual environment's Python for the driver, the executors and the ranks."""
    return {
        "AIRFLOW__HOROVOD__ARTIFACT_ROOT": "file://%s" % artifacts,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PATH": "%s:%s" % (Path(sys.executable).parent, os.environ.get("PATH", "")),
    }


class Deployment:
    """Airflow's API server, scheduler, DAG processor and triggerer on a throwaway PostgreSQL.

    :param root: a folder for AIRFLOW_HOME, the DAGs folder, the artifacts and the process logs.
    :param dag_files: the DAG files to copy into the DAGs folder.
    :param env: extra environment for every Airflow process (``AIRFLOW__...`` settings).
    :param path_prefix: the path the UI and the APIs are served under (``"/airflow"``: as behind a
        reverse proxy at ``https://host/airflow/``); ``[api] base_url`` carries it.
    """

    COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")

    def __init__(self, root: Path, dag_files: Iterable[Path], env: dict[str, str] | None = None,
                 path_prefix: str = "") -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # AIRFLOW_HOME, the logs and the artifacts are this user's alone
        self.home = self.root / "airflow"
        self.dags = self.root / "dags"
        self.artifacts = self.root / "artifacts"
        self.logs = self.root / "process-logs"
        for folder in (self.home, self.dags, self.artifacts, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        for source in dag_files:
            shutil.copy(source, self.dags / Path(source).name)
        self.postgres = Postgres()
        self.api_port = free_port()
        self.password = secrets.token_urlsafe(16)  # random: no other local user can guess a login
        self.base_url = "http://127.0.0.1:%d%s" % (self.api_port, path_prefix.rstrip("/"))
        self.procs: dict[str, subprocess.Popen] = {}
        self._api: Api | None = None
        self.shared_spark: Any = None  # a StandaloneCluster behind a connection, when the fixture starts one
        self.s3_root: str | None = None  # an s3:// root on a real S3 server, when the fixture gives one
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "%s/execution/" % self.base_url,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "%s:admin" % ADMIN_USER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__API__PORT": str(self.api_port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API_AUTH__JWT_EXPIRATION_TIME": "7200",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "2",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            **task_env(self.artifacts),
            **(env or {}),
        }
        self.env.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)  # the tasks fall back to an embedded local[2] Spark

    # -- life cycle ------------------------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def start(cls, root: Path, dag_files: Iterable[Path], env: dict[str, str] | None = None,
              path_prefix: str = "") -> Iterator[Deployment]:
        deployment = cls(root, dag_files, env, path_prefix)
        try:
            deployment.up()
            yield deployment
        finally:
            deployment.close()

    def up(self) -> None:
        self.postgres.start()
        self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = self.postgres.url
        self.write_login()
        migrate = subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, capture_output=True, text=True, timeout=600)
        if migrate.returncode != 0:
            raise DeploymentError("airflow db migrate failed:\n%s" % (migrate.stdout + migrate.stderr)[-4000:])
        # The API server first: it is also the execution API, and a task the scheduler starts before
        # it listens fails with "Connection refused" and an empty log.
        self._start_component("api-server")
        self._wait_healthy(("metadatabase",))
        for component in self.COMPONENTS[1:]:
            self._start_component(component)
        self._wait_healthy(("metadatabase", "scheduler", "dag_processor", "triggerer"))

    def write_login(self) -> None:
        """The admin's login for the simple auth manager, in a file only this user can read."""
        write_private(self.home / "passwords.json", json.dumps({ADMIN_USER: self.password}))

    def _start_component(self, component: str) -> None:
        with (self.logs / ("%s.log" % component)).open("wb") as log:
            self.procs[component] = subprocess.Popen([AIRFLOW, component], env=self.env, stdout=log,
                                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root)

    def _wait_healthy(self, parts: tuple[str, ...]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise DeploymentError("airflow %s exited with %s:\n%s" % (name, proc.returncode, self.process_log(name)))
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(self.base_url + "/api/v2/monitor/health", timeout=5).json()
                if all(health.get(part, {}).get("status") == "healthy" for part in parts):
                    return
            if time.monotonic() > deadline:
                raise DeploymentError("The deployment was not healthy within %ss.\n%s"
                                      % (STARTUP_TIMEOUT_S, "\n".join(self.process_log(n)[-1500:] for n in self.procs)))
            time.sleep(1)

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(self.base_url, self.password)
        return self._api

    def process_log(self, component: str) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / ("%s.log" % component)).read_text(errors="replace")
        return ""

    def close(self) -> None:
        """Stop every Airflow process (and the task processes under the scheduler), then PostgreSQL."""
        try:
            if self._api is not None:
                self._api.client.close()
            for name in ("scheduler", "triggerer", "dag-processor", "api-server"):
                proc = self.procs.get(name)
                if proc is not None:
                    _stop_tree(proc)
        finally:
            self.postgres.stop()

    # -- what the tests read besides the API -----------------------------------------------------
    def task_processes(self) -> list[psutil.Process]:
        """The LocalExecutor's task processes (``supervise`` children) running now, under the scheduler."""
        scheduler = self.procs.get("scheduler")
        if scheduler is None:
            return []
        found = []
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(scheduler.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    found.append(child)
        return found

    def artifact_folder(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> Path:
        task = task_id if map_index < 0 else "%s/map-%d" % (task_id, map_index)
        return self.artifacts / dag_id / run_id / task / ("try-%d" % try_number)

    def stored_try(self, dag_id: str, run_id: str, task_id: str, try_number: int, root: str | None = None) -> Any:
        """One try's folder as the store's own reading code sees it (an ``ObjectStoragePath``), under
        ``root`` (a task's own ``artifact_root``, e.g. ``s3_root``) or the deployment's artifact root."""
        from airflow_provider_horovod import store

        task = store.task_folder(root or "file://%s" % self.artifacts, dag_id, run_id, task_id)
        return store.try_folder(task, try_number)
