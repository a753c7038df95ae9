"""The run's secret and its keys are in no process's environment or command line, and Spark's own
worker secret does not reach the run's processes. Finding 5 of issue #10, on a real run."""

from __future__ import annotations

import glob
import os
import stat
import tempfile

import psutil
import pytest

from airflow_provider_horovod import HorovodRunner, RunCancelledError
from airflow_provider_horovod.runner import wire
from airflow_provider_horovod.runner.spec import RunSpec
from tests.conftest import ours, run_processes
from tests.integration.test_runner import train_in_background

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

SECRET = bytes(range(32))
KEYS = [SECRET.hex()] + [wire.role_key(SECRET, role).hex()
                         for role in (wire.ROLE_TASK, wire.ROLE_RANK, wire.ROLE_EXEC, wire.rank_role(0), wire.rank_role(1))]


def _run_processes() -> list[psutil.Process]:
    """Ranks, mpirun, orted, reapers and the rsh agent of this test session."""
    agents = [p for p in psutil.process_iter(["cmdline"]) if ours(p) and _is_agent(p.info["cmdline"] or [])]
    return run_processes() + agents


def _is_agent(argv: list[str]) -> bool:
    """``<python> -m airflow_provider_horovod.runner.launchers.mpirun_rsh <host> orted ...`` (not orted, whose
    options name the agent in one word)."""
    return any(a == "-m" and b == "airflow_provider_horovod.runner.launchers.mpirun_rsh" for a, b in zip(argv, argv[1:]))


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_no_process_of_a_run_holds_a_key_in_its_environment_or_argv(spark, monkeypatch, tmp_path, launcher):
    monkeypatch.setattr(wire, "new_secret", lambda: SECRET)
    runner = HorovodRunner(2, launcher=launcher, spark=spark)
    thread, errors = train_in_background(runner, tmp_path)
    try:
        seen, leaks, agents_seen = [], [], 0
        for proc in _run_processes():
            try:
                environ, argv = proc.environ(), " ".join(proc.cmdline())
            except psutil.Error:
                continue
            seen.append(argv)
            agents_seen += _is_agent(proc.cmdline())
            text = argv + "\n" + "\n".join("%s=%s" % kv for kv in environ.items())
            leaks += ["%d %s: %s" % (proc.pid, argv[:80], what) for what in KEYS + ["HVDRUNNER_SECRET", "PYTHON_WORKER_FACTORY_SECRET"]
                      if what in text or what.upper() in text]
        task_dirs = glob.glob(os.path.join(tempfile.gettempdir(), "hvdrunner-%s-*" % runner.last_run.run_id))
        key_files = [f for d in task_dirs for f in glob.glob(os.path.join(d, "*.key"))]
        modes = {stat.S_IMODE(os.stat(p).st_mode) for f in key_files for p in (f, os.path.dirname(f))}
    finally:
        runner.cancel()
        thread.join(30)
    assert [type(e) for e in errors] == [RunCancelledError]
    ranks = [a for a in seen if a.endswith("-m airflow_provider_horovod.runner.rank.worker") and "mpirun" not in a]
    assert len(ranks) == 2  # we looked while both ranks trained
    if launcher == "mpirun":
        assert any("orted" in a for a in seen) and agents_seen
    assert leaks == []
    # each rank took its key and removed the file; only the rsh agent's stays while mpirun runs, 0600
    assert [os.path.basename(f) for f in key_files] == (["exec.key"] if launcher == "mpirun" else [])
    assert modes == ({0o600, 0o700} if key_files else set())


def test_the_run_spec_does_not_show_its_secret():
    spec = RunSpec(run_id="r", secret=SECRET, payload=b"p", launcher="gloo", verbosity="all", channel=None,
                   env={"TOKEN": "user value"}, driver_python="3.11")
    assert SECRET.hex() not in repr(spec) and repr(SECRET) not in repr(spec) and "user value" not in repr(spec)
