"""The engine's rooms and the arrows between them (DESIGN decision 23), read from the code's own
imports with ``ast``: every ``import`` and ``from ... import`` under ``airflow_provider_horovod/runner/``,
at module level or inside a function, ``TYPE_CHECKING`` blocks included.

Rooms: ``driver/`` (the process that calls ``HorovodRunner.run``), ``task/`` (each Spark barrier
task), ``launchers/`` (entered from the task side), ``rank/`` (each rank process) and the shared
modules directly in ``runner/``. The launchers' table, ``launchers/__init__.py`` (the package itself:
``Launcher``, ``LAUNCHERS``, ``launcher_of``), is a shared module: every role asks it what a launcher
is (the rank included: which names say its rank, whether ``hvd.init()`` is allowed), so it imports
nothing of the engine at all, only the standard library, and names each launcher's module as a
string that ``launcher_of`` imports when the task side asks. Arrows run down, from a caller to what
it calls:

- the launchers' table imports no module of the engine (the standard library only);
- the shared modules import no room (every role imports them);
- ``launchers/`` imports neither ``task/`` nor ``driver/`` (the task side calls the launchers);
- ``rank/`` imports none of ``task/``, ``driver/``, ``launchers/`` (they start the rank);
- ``task/`` does not import ``driver/`` (the driver runs the barrier stage);
- no module of the engine is part of an import cycle.

``runtime.py``, what training code imports, stands at the package's top for its users but runs in
the rank process (the rank sets its channel client there): it counts as a module of ``rank/``.

Deliberate exceptions, each an arrow this test leaves out (``EXCEPTIONS``), with its reason:

- ``runtime`` -> ``task.shipper``: ``runtime.commit_checkpoint`` writes a commit request with
  ``shipper.request_commit``, whose folder names and order the shipper in rank 0's task reads back;
  the writer stands beside its one reader. It is a function call inside ``commit_checkpoint`` and
  imports nothing of the task when a rank starts.

A rank's command, ``launchers.processes.WORKER``, names ``runner.rank.worker`` as a string for
``python -m``: a process started, not an import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import airflow_provider_horovod.runner as runner_package

RUNNER = Path(runner_package.__file__).parent
PACKAGE = runner_package.__name__
ROOMS = ("driver", "task", "launchers", "rank")
SHARED = "shared"

FORBIDDEN = {
    SHARED: {"driver", "task", "launchers", "rank"},
    "launchers": {"task", "driver"},
    "rank": {"task", "driver", "launchers"},
    "task": {"driver"},
    "driver": set(),
}
RUNTIME = "%s.runtime" % PACKAGE.rpartition(".")[0]  # the training code's face, a module of the rank
EXCEPTIONS = {  # (importer, imported): arrows left out of every rule, each with its reason in the docstring
    (RUNTIME, "%s.task.shipper" % PACKAGE),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNNER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def engine_modules() -> dict[str, Path]:
    return {**{module_name(path): path for path in sorted(RUNNER.rglob("*.py"))},
            RUNTIME: RUNNER.parent / "runtime.py"}


TABLE = "%s.launchers" % PACKAGE  # the launchers' table: the package's own module, shared by every role


def room_of(module: str) -> str:
    if module == RUNTIME:
        return "rank"
    first = module[len(PACKAGE) + 1 :].split(".")[0] if module != PACKAGE else ""
    return first if first in ROOMS and module != TABLE else SHARED


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The engine modules ``module`` imports, anywhere in its text (``from pkg import mod`` names ``pkg.mod``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = "%s.%s" % (node.module, alias.name)
                if child in modules or node.module in modules:
                    out.add(child if child in modules else node.module)
    out.discard(module)
    return {target for target in out if (module, target) not in EXCEPTIONS}


def import_graph() -> dict[str, set[str]]:
    modules = engine_modules()
    return {module: imported(module, path, modules) for module, path in modules.items()}


def test_the_engine_has_its_four_rooms():
    assert {room_of(module) for module in import_graph()} == {SHARED, *ROOMS}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_never_imports_its_callers(room):
    wrong = sorted(
        "%s imports %s" % (module, target)
        for module, targets in import_graph().items()
        if room_of(module) == room
        for target in targets
        if room_of(target) in FORBIDDEN[room]
    )
    assert not wrong, "arrows that run up, out of %s: %s" % (room, wrong)


def test_the_launchers_table_imports_the_standard_library_only():
    path = engine_modules()[TABLE]
    outside = sorted(
        name
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "."] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                     ["." * getattr(node, "level", 0)] if isinstance(node, ast.ImportFrom) else [])
        if name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
    )
    assert not outside, "the launchers' table is imported by every role and must import nothing else: %s" % outside


def test_the_rules_see_a_wrong_arrow():
    graph = {"%s.launchers.gloo" % PACKAGE: {"%s.task.barrier" % PACKAGE},
             "%s.rank.worker" % PACKAGE: {"%s.launchers.gloo" % PACKAGE}}
    assert len([t for m, ts in graph.items() for t in ts if room_of(t) in FORBIDDEN[room_of(m)]]) == 2
    assert room_of(TABLE) == SHARED and room_of("%s.launchers.torch" % PACKAGE) == "launchers"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_the_engine_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_seen():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
