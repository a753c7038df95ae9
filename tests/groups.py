"""How the suite is split between pytest-xdist's workers: THE one place that says it (issue 52).

``scripts/test`` runs ``pytest -n 2 --dist loadgroup``; ``tests/conftest.py`` then hands xdist the
scheduler below instead of its own. A *group* is the unit a worker takes whole, start to end:

- every test file is a group of its own by default (its module- and package-scoped fixtures, a
  standalone cluster, a bed, a deployment, are made once, on one worker);
- the table ``GROUPS`` merges files that share something that must not be used twice at once, or
  that must be made only once (a package-scoped deployment), and gives the heavy groups their
  measured seconds, so that the heaviest start first (longest first: the two workers end together);
- a group marked ``alone`` runs after every other group, while the other worker is idle (a test
  whose assertion is about wall time and whose margin does not hold beside another group).

What the groups share, and why that is safe side by side (audited for issue 52):
- ports: every server the tests start (Spark masters, workers, their UIs, the deployment's API server
  and log servers, moto, MLflow) binds a free port the kernel chose (``cluster.free_port``); Spark's
  own driver, block manager and UI ports are chosen by Spark with retries;
- folders: every test and fixture writes under pytest's ``tmp_path``/``tmp_path_factory``, which
  xdist makes per worker (``.../popen-gwN``); the engine's runs dir (``HVDRUNNER_RUNS_DIR``) is made
  there too; the venvs kept in the cache (``venvs.cached_venv``) are used under a file lock;
- processes: the leftover-process checks see only their own worker's processes
  (``HVDRUNNER_TEST_SESSION`` is made per worker in ``tests/conftest.py``);
- network namespaces: each bed has a random id, its own bridge and subnet; ``netbed.sweep`` removes
  only beds whose owning process is gone. The two bed files still form one group (``beds``): both
  use root-only machinery (namespaces, mounts, tc) and the host's name tables, and one bed at a time
  is what was measured;
- Spark's class-data archive (``tests/jvm.py``) is made once per virtualenv before any worker starts
  (the controller's ``pytest_sessionstart``; a file lock makes any other maker wait for it); the
  deployment's PostgreSQL database belongs to the ``deployment`` group alone, the built wheel to
  ``test_built_wheel.py`` alone: no other group reaches either.

After the run, the summary's ``schedule`` section (``tests/conftest.py``) gives each worker's groups, from
their first to their last report, and the seconds between the two workers' ends (the tail), so an order
or a split can be judged by measurement.

Run one group alone: ``./scripts/test --group beds`` (the group's name, or a file's path for a file of
its own); serially, as before: ``./scripts/test -n 0``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    paths: tuple[str, ...]  # files, or folders ending in "/", relative to the repository
    seconds: float  # alone, from docs/test-timing.md: the heaviest groups are handed out first
    alone: bool = False  # runs last, with the other worker idle
    why: str = ""


GROUPS = [
    Group("deployment", ("tests/integration/on_deployment/",), 345,
          why="one package-scoped deployment (PostgreSQL, four Airflow services, a 4-worker cluster, Chromium)"),
    Group("beds", ("tests/integration/test_hosts.py", "tests/integration/test_hosts_loopback_names.py"), 152,
          why="network namespaces, bridges, mounts: one multi-host bed at a time"),
    Group("airflow-dags", ("tests/integration/test_airflow_dags.py",), 205),
    Group("runner", ("tests/integration/test_runner.py",), 175),
    Group("cluster", ("tests/integration/test_cluster.py",), 145),
    Group("stall", ("tests/integration/test_stall.py",), 71),
    Group("lowest-versions", ("tests/integration/test_lowest_versions.py",), 70),
    Group("artifacts", ("tests/integration/test_artifacts.py",), 59),
    Group("built-wheel", ("tests/integration/test_built_wheel.py",), 58),
    Group("parity", ("tests/integration/test_parity.py",), 40),
    Group("durable-checkpoints", ("tests/integration/test_durable_checkpoints.py",), 38),
    Group("torch-launcher", ("tests/integration/test_torch_launcher.py",), 38),
    Group("restarts", ("tests/integration/test_restarts.py",), 37),
    Group("warm-ranks", ("tests/integration/test_warm_ranks.py",), 40),
    Group("tensorflow", ("tests/integration/test_tensorflow.py",), 36),
    Group("doc-snippets", ("tests/integration/test_doc_snippets.py",), 34),
    Group("dataset", ("tests/integration/test_dataset.py",), 30),
    Group("light-install", ("tests/integration/test_light_install.py",), 27),
    Group("environment", ("tests/integration/test_environment.py",), 27),
]
BY_NAME = {g.name: g for g in GROUPS}
DEFAULT_SECONDS = 3.0  # a file of its own not in the table (the unit and security files: seconds each)


def path_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def group_of(nodeid: str) -> Group:
    """The group a test belongs to: the table's, or its file's own."""
    path = path_of(nodeid)
    for group in GROUPS:
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in group.paths):
            return group
    return Group(path, (path,), DEFAULT_SECONDS)


def names() -> list[str]:
    return [g.name for g in GROUPS]


def make_scheduler(config, log):
    """xdist's ``loadgroup`` scheduler with this module's groups: whole groups to a worker, the
    heaviest first, ``alone`` groups last on an otherwise idle worker."""
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid).name

        def _idle_but(self, node) -> bool:
            return all(self._pending_of(work) == 0 for other, work in self.assigned_work.items() if other is not node)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the heaviest first, then in collection order; alone groups last
                def weight(item):
                    group = group_of(next(iter(item[1])))
                    return (group.alone, -group.seconds)
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=weight))
                self.ordered = True
            first = next(iter(self.workqueue.values()))
            if group_of(next(iter(first))).alone and not self._idle_but(node):
                return  # held until the other workers are idle (mark_test_complete tries again)
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index, duration=0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a worker held back for an alone group, or left without work
                if other is not node and self._pending_of(self.assigned_work[other]) == 0:
                    self._reschedule(other)

    return Scheduling(config, log)
