"""Runs collectives.py with pytest inside one Horovod rank and records each test's outcome.

Two ways in, the same work:
- ``python run_in_rank.py OUT_DIR`` under ``horovodrun`` (this file is the rank's program);
- ``HorovodRunner(...).run(run_collectives, out_dir)``: the runner ships ``run_collectives`` by
  value (this module is not installed), so it must not rely on ``tests`` being importable or on
  the rank's working directory: every path it uses is absolute and computed here, on the driver.

Each rank writes ``rank-<r>.json`` (``{"rank", "size", "exit_code", "outcomes", "details"}``) into
``OUT_DIR``; ``outcomes`` maps every test id to "passed", "failed", "skipped" or "error" (a failure
outside the test's call: setup or teardown).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MODULE = str(Path(__file__).resolve().with_name("collectives.py"))
RESULT_FILE = "rank-%d.json"
# pytest's exit codes for "ran, some tests may have failed"; anything else means it did not run.
RAN = (0, 1)


class OutcomeRecorder:
    """A pytest plugin: the outcome of every test's call, or of the phase that ended it early."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.details: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call":
            self.outcomes[report.nodeid] = report.outcome
        elif report.failed:  # setup or teardown raised
            self.outcomes[report.nodeid] = "error"
        elif report.when == "setup" and report.skipped:
            self.outcomes[report.nodeid] = "skipped"
        else:
            return
        if report.failed:
            self.details[report.nodeid] = "%s: %s" % (report.when, _crash(report))

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:  # e.g. hvd.init() raised at import: the module has no tests at all
            self.outcomes[report.nodeid or "<collection>"] = "error"
            self.details[report.nodeid or "<collection>"] = "collect: %s" % _crash(report)


def _crash(report: Any, limit: int = 400) -> str:
    """The exception line pytest shows for a failure (``AssertionError: ...``), shortened."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    else:
        lines = [line.strip() for line in report.longreprtext.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_collectives(out_dir: str, module: str = MODULE) -> dict[str, Any]:
    """Run ``module`` with pytest in this rank; write and return this rank's ``rank-<r>.json``."""
    import pytest

    recorder = OutcomeRecorder()
    args = [
        module, "-q", "-p", "no:cacheprovider", "--color=no",
        # Only this module: not the project's conftest.py, pyproject.toml options or sys.path.
        "--noconftest", "-c", os.devnull, "--rootdir", os.path.dirname(module), "--import-mode=importlib",
    ]
    exit_code = int(pytest.main(args, plugins=[recorder]))

    import horovod.torch as hvd

    rank = hvd.rank() if hvd.is_initialized() else int(os.environ.get("HOROVOD_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
    result = {
        "rank": rank,
        "size": hvd.size() if hvd.is_initialized() else None,
        "exit_code": exit_code,
        "outcomes": recorder.outcomes,
        "details": recorder.details,
    }
    path = Path(out_dir) / (RESULT_FILE % rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
    os.replace(tmp, path)
    if exit_code not in RAN:
        raise RuntimeError("pytest did not run %s in rank %d (exit code %d)" % (module, rank, exit_code))
    return result


def read_results(out_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every ``rank-<r>.json`` in ``out_dir``, by rank."""
    results = {}
    for path in sorted(Path(out_dir).glob("rank-*.json")):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: %s OUT_DIR" % sys.argv[0])
    run_collectives(sys.argv[1])
