"""A throwaway AIRFLOW_HOME on SQLite, and ``airflow dags test`` run in it without paying the
CLI's start-up each time.

:meth:`AirflowHome.dags_test` runs the CLI's own code, ``airflow.__main__.main()`` with the argv of
``airflow dags test``, in a process forked from a long-lived server (``python -m
tests.integration.airflow_home SOCKET``, one per home) that has already imported Airflow and built
the in-process execution API, Cadwyn's versioned routers included. A new ``airflow dags test``
spends ~5 s of one core on those before its first task starts on an idle machine here (8.2-8.7 s
for a DAG whose five tasks fail before Spark, 3.2-3.3 s forked; ~12 s when the machine is busy).

The fork is otherwise the CLI's own process: its own pid (a test can signal it), stdin on
/dev/null, stdout and stderr on pipes (as with ``subprocess.run``), its own parsing of the DAGs
folder, its own SparkSession, JVM and ranks, its exit status from the CLI's ``SystemExit``, and
the interpreter's own exit (atexit, thread joins) at the end. The server imports only what the
console script imports, sets nothing in the environment (it starts with the home's), and forks
only while it runs a single thread; Airflow's own ``register_at_fork`` hook gives each child fresh
database connections. What only a new interpreter shows (the console script's start-up) stays
with the tests that start ``airflow`` themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
READY = "dags-test server ready"
DAG_TIMEOUT_S = 300


class AirflowHome:
    """A throwaway AIRFLOW_HOME with a migrated SQLite DB, the example DAGs and the test DAGs."""

    def __init__(self, root: Path) -> None:
        from tests.integration.deployment import task_env

        self.root = root
        self.home = root / "airflow"
        self.dags = root / "dags"
        self.artifacts = root / "artifacts"
        self.dags.mkdir(parents=True)
        for source in [*sorted((REPO / "dags").glob("*.py")), *sorted((REPO / "tests/integration/airflow_dags").glob("*.py"))]:
            shutil.copy(source, self.dags / source.name)
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            **task_env(self.artifacts),
            # spark_default is left undefined on purpose: the tasks fall back to embedded local[2].
        }
        self.env.pop("AIRFLOW_CONN_SPARK_DEFAULT", None)
        self._server: subprocess.Popen | None = None
        self._socket = root / "dags-test.sock"
        if len(str(self._socket)) > 100:  # AF_UNIX paths end at 108 bytes; mkdtemp's folder is 0700 as root's
            self._socket = Path(tempfile.mkdtemp(prefix="hvd-dags-test-")) / "s"
        self._server_log = root / "dags-test-server.log"
        subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, check=True, capture_output=True, timeout=300)

    # --- running DAGs

    def dags_test(self, dag_id: str, *args: str, timeout: float = DAG_TIMEOUT_S, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
        """``airflow dags test <dag_id> <args>`` in a process forked from the server (started on first use)."""
        argv = ["dags", "test", dag_id, *args]
        forked = Forked(self.start_server(), argv, env or {})
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [threading.Thread(target=_drain, args=(forked.stdout, out), daemon=True),
                   threading.Thread(target=_drain, args=(forked.stderr, err), daemon=True)]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        try:
            forked.wait(timeout)
            for reader in readers:  # as subprocess.run: until every holder of the pipes has closed them
                reader.join(max(0.0, deadline - time.monotonic()))
                if reader.is_alive():
                    raise subprocess.TimeoutExpired(["airflow", *argv], timeout)
        except subprocess.TimeoutExpired:
            forked.kill()
            raise
        return subprocess.CompletedProcess(["airflow", *argv], forked.returncode, b"".join(out).decode(errors="replace"),
                                           b"".join(err).decode(errors="replace"))

    def start_server(self) -> Path:
        """The dags-test server's socket, once it is ready (started here if it is not running)."""
        if self._server is not None and self._server.poll() is None:
            return self._socket
        assert self._server is None, "the dags-test server died:\n" + self._server_log.read_text()[-6000:]
        log = self._server_log.open("wb")
        self._server = subprocess.Popen([sys.executable, "-m", "tests.integration.airflow_home", str(self._socket)],
                                        env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 300
        while READY not in self._server_log.read_text(errors="replace"):
            assert self._server.poll() is None, "the dags-test server died:\n" + self._server_log.read_text()[-6000:]
            assert time.monotonic() < deadline, "the dags-test server is not up:\n" + self._server_log.read_text()[-6000:]
            time.sleep(0.1)
        return self._socket

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(15)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._socket.unlink(missing_ok=True)
        if self._socket.parent != self.root:
            self._socket.parent.rmdir()

    # --- reading results back from the metadata database

    def query(self, sql: str, *args: object) -> list[tuple]:
        with sqlite3.connect(self.home / "airflow.db") as db:
            return db.execute(sql, args).fetchall()

    def last_run_id(self, dag_id: str) -> str:
        return self.query("SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", dag_id)[0][0]

    def xcom(self, dag_id: str, task_id: str, key: str = "return_value") -> object:
        rows = self.query("SELECT value FROM xcom WHERE dag_id = ? AND task_id = ? AND key = ? AND run_id = ?",
                          dag_id, task_id, key, self.last_run_id(dag_id))
        assert rows, "no %s XCom for %s.%s" % (key, dag_id, task_id)
        value = rows[0][0]
        return json.loads(value) if isinstance(value, (str, bytes)) else value

    def task_states(self, dag_id: str) -> dict[str, tuple[str, int]]:
        rows = self.query("SELECT task_id, state, try_number FROM task_instance WHERE dag_id = ? AND run_id = ?",
                          dag_id, self.last_run_id(dag_id))
        return {task: (state, tries) for task, state, tries in rows}

    def asset_extras(self, name: str) -> list[dict]:
        rows = self.query("SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE a.name = ? "
                          "ORDER BY e.id", name)
        return [json.loads(extra) if isinstance(extra, str) else extra for (extra,) in rows]


def _drain(stream, into: list[bytes]) -> None:
    with stream:
        while chunk := stream.read1(65536):
            into.append(chunk)


class Forked:
    """One request to the server: a forked ``airflow <argv>`` whose stdout and stderr are this
    object's pipes; ``pid`` is the CLI process itself, ``wait`` gives its exit status."""

    def __init__(self, server: Path, argv: list[str], env: dict[str, str]) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(str(server))
            socket.send_fds(self._conn, [json.dumps({"argv": argv, "env": env}).encode()], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = os.fdopen(out_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")
        self._replies = b""
        self.pid = int(self._reply(None)["pid"])

    def _reply(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._replies:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired("airflow (forked)", timeout)
            chunk = self._conn.recv(4096)
            assert chunk, "the dags-test server closed the connection early (see dags-test-server.log)"
            self._replies += chunk
        line, self._replies = self._replies.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._reply(timeout)["returncode"])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            self.wait(30)


# --- the server (``python -m tests.integration.airflow_home SOCKET``), in the home's environment


async def _warm_up(app) -> int:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    path = "/dags-test-server-warm-up"
    await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
               "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
               "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}, receive, send)
    return sent[0]["status"]


def _serve(path: str) -> dict:
    """Warm up, then fork one ``airflow`` CLI process per request; the parent never returns, each
    child returns its request (argv and extra environment) with stdout/stderr already on its pipes."""
    import airflow.__main__  # noqa: F401  (the console script's module: configuration, the CLI parser)
    from airflow.cli import cli_parser
    from airflow.cli.commands import dag_command  # noqa: F401  (imported lazily by the CLI; heavy)
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    cli_parser.get_parser()
    # The execution API's Cadwyn app, built once here and cached for every fork; Cadwyn generates
    # its versioned routers on the app's first request (~3 s here), so one request to a path that
    # does not exist (404, no route, no database) makes that happen here too. asyncio.run leaves no
    # thread behind; the lifespan and the transport's loop thread start in each child, as in the CLI.
    app = in_process_api_server().app
    warm = asyncio.run(_warm_up(app))
    assert warm == 404, warm

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(1)
    print(READY, flush=True)
    parent = os.getppid()
    while True:
        if not select.select([listener], [], [], 5)[0]:
            if os.getppid() != parent:  # the test session is gone (killed): so is this server
                os.unlink(path)
                sys.exit(0)
            continue
        conn, _ = listener.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            request = json.loads(message)
            threads = threading.enumerate()
            assert len(threads) == 1, "refusing to fork with threads running: %s" % threads
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(fds[0], 1)
                os.dup2(fds[1], 2)
                for fd in (devnull, *fds):
                    os.close(fd)
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(b'{"pid": %d}\n' % pid)
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(b'{"returncode": %d}\n' % os.waitstatus_to_exitcode(status))
            except OSError:
                pass  # the client has gone (it timed out and killed the child)


if __name__ == "__main__":
    _request = _serve(sys.argv[1])
    os.environ.update(_request["env"])
    sys.argv = [AIRFLOW, *_request["argv"]]
    from airflow.__main__ import main

    sys.exit(main())
