"""The runner's ranks behave as bare ``horovodrun``'s: a broad collective test module, run with
pytest inside every rank, has the same outcome per test and per rank under ``horovodrun --gloo``,
``horovodrun --mpi`` and ``HorovodRunner`` with each launcher.

The module is parity/collectives.py; parity/run_in_rank.py runs it in a rank and writes
``rank-<r>.json`` (test id -> outcome) into a folder this test reads.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner
from tests.integration.parity import run_in_rank

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
NP = 2
# Tests in collectives.py at two ranks (allreduce is parametrized over its five ops).
EXPECTED_TESTS = 22


@dataclasses.dataclass
class Contender:
    """One way of launching the ranks, and what its ranks recorded."""

    name: str
    results: dict[int, dict[str, Any]] = dataclasses.field(repr=False)  # rank -> its rank-<r>.json
    ending: str = dataclasses.field(repr=False)  # how the launch ended, for the assertion message
    returned: Any = None  # rank 0's return value (runner only)

    def outcomes(self, rank: int) -> dict[str, str]:
        return self.results.get(rank, {}).get("outcomes", {})

    def detail(self, rank: int, test: str) -> str:
        return self.results.get(rank, {}).get("details", {}).get(test, "")


def run_horovodrun(controller: str, out_dir: Path) -> Contender:
    env = dict(os.environ, PATH="%s:%s" % (BIN, os.environ["PATH"]))
    argv = [str(BIN / "horovodrun"), "-np", str(NP), "-H", "localhost:%d" % NP, controller,
            sys.executable, run_in_rank.__file__, str(out_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    ending = "exit code %d" % proc.returncode
    if proc.returncode != 0:
        ending += "; output ends with:\n%s" % (proc.stdout + proc.stderr)[-3000:]
    return Contender("horovodrun %s" % controller, run_in_rank.read_results(out_dir), ending)


def run_runner(spark, launcher: str, out_dir: Path) -> Contender:
    returned, ending = None, "returned"
    try:
        returned = HorovodRunner(NP, launcher=launcher, spark=spark).run(run_in_rank.run_collectives, str(out_dir))
    except HorovodRunError as err:
        ending = "raised %s: %s" % (type(err).__name__, err)
    return Contender("HorovodRunner launcher=%s" % launcher, run_in_rank.read_results(out_dir), ending, returned)


def differences(contenders: list[Contender]) -> str:
    """A readable table of every (rank, test) whose outcome is not the same for all contenders."""
    lines = []
    for c in contenders:
        missing = sorted(set(range(NP)) - set(c.results))
        if missing:
            lines.append("%s: no outcomes from rank(s) %s" % (c.name, ", ".join(map(str, missing))))
    for rank in range(NP):
        tests = sorted(set().union(*(c.outcomes(rank) for c in contenders)))
        for test in tests:
            seen = [c.outcomes(rank).get(test, "missing") for c in contenders]
            if len(set(seen)) > 1:
                lines.append("rank %d %s" % (rank, test))
                for c, outcome in zip(contenders, seen):
                    detail = c.detail(rank, test)
                    lines.append("    %-30s %s%s" % (c.name, outcome, "  (%s)" % detail if detail else ""))
    if lines:
        lines += ["", "How each launch ended:"] + ["  %s: %s" % (c.name, c.ending) for c in contenders]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def bare_horovodrun(tmp_path_factory) -> list[Contender]:
    root = tmp_path_factory.mktemp("parity-horovodrun")
    return [run_horovodrun(controller, root / controller.strip("-")) for controller in ("--gloo", "--mpi")]


def test_bare_horovodrun_passes_every_collective_test_on_every_rank(bare_horovodrun):
    for contender in bare_horovodrun:
        assert sorted(contender.results) == list(range(NP)), "%s: %s" % (contender.name, contender.ending)
        for rank in range(NP):
            outcomes = contender.outcomes(rank)
            failed = {t: contender.detail(rank, t) for t, o in outcomes.items() if o != "passed"}
            assert len(outcomes) == EXPECTED_TESTS, "%s rank %d ran %d tests" % (contender.name, rank, len(outcomes))
            assert failed == {}, "%s rank %d" % (contender.name, rank)
    diff = differences(bare_horovodrun)
    assert not diff, "horovodrun --gloo and --mpi disagree:\n" + diff


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_runner_ranks_see_the_same_collective_outcomes_as_bare_horovodrun(spark, bare_horovodrun, launcher, tmp_path):
    contender = run_runner(spark, launcher, tmp_path / launcher)
    diff = differences(bare_horovodrun + [contender])
    assert not diff, "outcomes differ from bare horovodrun's:\n" + diff
    # the runner hands back rank 0's return value: its own record
    assert contender.returned == contender.results[0], contender.ending
