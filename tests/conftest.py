"""Shared fixtures: one real ``local[2]`` SparkSession per test session, process checks."""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import psutil
import pytest

from tests import groups, jvm

# Every process this test session starts (executors, ranks, orted) inherits this marker, so the
# leftover checks below see only our own processes, not those of another session on the machine.
# Each pytest-xdist worker is a session of its own here (the workers inherit the controller's
# environment: without a marker of their own, one worker's check would see the other's ranks).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ.get("HVDRUNNER_TEST_SESSION_WORKER") != _WORKER:
    os.environ["HVDRUNNER_TEST_SESSION"] = uuid.uuid4().hex
    os.environ["HVDRUNNER_TEST_SESSION_WORKER"] = _WORKER
TEST_SESSION = os.environ.setdefault("HVDRUNNER_TEST_SESSION", uuid.uuid4().hex)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")


_archive_maker: threading.Thread | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every Spark JVM of the suite starts with ``tests/jvm.py``'s options (set before any starts).

    Under pytest-xdist the class-data archive is still made once per virtualenv, by the controller
    (which starts no JVM of its own), while the workers start and collect the suite (30 s and more);
    each worker sets the options once it has collected (``pytest_collection_finish``), waiting on the
    archive's lock if it is still being made. Whoever takes the lock first makes it; the others find
    it made."""
    global _archive_maker
    config = session.config
    if hasattr(config, "workerinput"):
        return
    if config.getoption("dist", "no") != "no":
        _archive_maker = threading.Thread(target=jvm.environment, name="class-data-archive", daemon=True)
        _archive_maker.start()
        return
    os.environ.update(jvm.environment())


def pytest_collection_finish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: before its first test
        os.environ.update(jvm.environment())


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _archive_maker is not None:  # never leave the maker's JVM behind (a run shorter than it)
        _archive_maker.join()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--group", action="append", default=[], metavar="NAME",
                     help="run only this group of tests/groups.py (a name of its table, or a test file's path); "
                          "may be given more than once. Groups: %s" % ", ".join(groups.names()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--group NAME``: only that group's tests are run (tests/groups.py)."""
    wanted = set(config.getoption("group"))
    if not wanted:
        return
    unknown = {w for w in wanted if w not in groups.BY_NAME and not os.path.exists(w)}
    if unknown:
        raise pytest.UsageError("--group: no such group: %s (groups: %s, or a test file's path)"
                                % (", ".join(sorted(unknown)), ", ".join(groups.names())))
    kept, left = [], []
    for item in items:
        (kept if groups.group_of(item.nodeid).name in wanted else left).append(item)
    config.hook.pytest_deselected(items=left)
    items[:] = kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (scripts/test) splits the suite by tests/groups.py's table."""
    if config.getvalue("dist") == "loadgroup":
        return groups.make_scheduler(config, log)
    return None


# The schedule as the xdist controller saw it (issue 52: does a worker idle at the end?): per worker,
# each group's first and last report, in seconds from the session's start.
_SESSION_STARTED = time.monotonic()
_schedule: dict[str, dict[str, list[float]]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the controller: the worker that ran the test
    if node is None:
        return
    now = time.monotonic() - _SESSION_STARTED
    spans = _schedule.setdefault(node.gateway.id, {})
    span = spans.setdefault(groups.group_of(report.nodeid).name, [now - report.duration, now])
    span[1] = now


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """``scripts/test``'s last lines: when each worker ran its groups and when it ended (the tail)."""
    if not _schedule:
        return
    write = terminalreporter.write_line
    terminalreporter.section("schedule (tests/groups.py; seconds from the session's start)")
    ends = {}
    for worker, spans in sorted(_schedule.items()):
        ends[worker] = max(end for _start, end in spans.values())
        heavy = ["%s %.0f-%.0f" % (name, start, end) for name, (start, end) in spans.items() if end - start >= 10]
        small = sum(end - start for start, end in spans.values() if end - start < 10)
        write("%s: %s; %d groups under 10 s (%.0f s); ended at %.0f s"
              % (worker, ", ".join(heavy), sum(1 for s, e in spans.values() if e - s < 10), small, ends[worker]))
    if len(ends) > 1:
        write("tail: the last worker ended %.0f s after the first" % (max(ends.values()) - min(ends.values())))


@pytest.fixture(scope="session", autouse=True)
def engine_runs_dir(tmp_path_factory) -> str:
    """Engine runs given no ``artifact_dir`` keep their folders under the session's temporary folder
    (``HVDRUNNER_RUNS_DIR``), never in the user's ``~/.cache``; processes the tests start inherit it."""
    os.environ["HVDRUNNER_RUNS_DIR"] = str(tmp_path_factory.mktemp("engine-runs"))
    return os.environ["HVDRUNNER_RUNS_DIR"]


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("airflow-provider-horovod-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    yield session
    session.stop()


RANK_PROCESS_MARKERS = ("airflow_provider_horovod.runner.rank.worker", "orted", "mpirun", "airflow_provider_horovod.runner.procs")


def ours(proc: psutil.Process) -> bool:
    try:
        return proc.environ().get("HVDRUNNER_TEST_SESSION") == TEST_SESSION
    except psutil.Error:
        return False


def run_processes() -> list[psutil.Process]:
    """Rank processes, orted, mpirun and reapers started by this test session that are still alive."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not ours(proc):
                continue
            cmd = " ".join(proc.info["cmdline"] or [])
            name = proc.info["name"] or ""
            if name in ("orted", "mpirun") or any(m in cmd for m in RANK_PROCESS_MARKERS[:1] + RANK_PROCESS_MARKERS[3:]):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_no_run_processes(timeout: float = 10.0) -> list[str]:
    """Wait until no runner process is left; return the command lines of those still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = run_processes()
        if not left or time.monotonic() > deadline:
            out = []
            for p in left:
                try:
                    out.append("%d %s" % (p.pid, " ".join(p.cmdline())))
                except psutil.Error:
                    pass
            return out
        time.sleep(0.2)


@pytest.fixture
def no_leftover_processes():
    """Asserts after the test that every rank, orted, mpirun and reaper is gone within 10 s."""
    yield
    left = wait_no_run_processes(10.0)
    assert left == [], "processes left behind: %s" % left


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (``moto_server``) on 127.0.0.1 for the whole session, reached through the
    Airflow connection ``tests.s3.CONN_ID`` (in the environment: ``airflow dags test`` sees it too)."""
    from tests import s3

    with s3.serving() as server:
        yield server


@pytest.fixture(params=["file", "s3"])
def artifact_root(request, tmp_path):
    """An empty artifact root, once on local disk (``file://``) and once in a fresh bucket (``s3://``)."""
    if request.param == "file":
        return "file://%s" % (tmp_path / "store")
    from tests import s3

    return s3.uri(request.getfixturevalue("s3_server").new_bucket(), "store")
