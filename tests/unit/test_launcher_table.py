"""Adding a launcher is a module under ``runner/launchers/`` and one entry in its table
(``runner/launchers/__init__.py``): ``docs/architecture.md`` lists those files, and these tests hold the
list true.

The rest of the package asks the table (``LAUNCHERS``, ``facts_of``, ``rank_names``, ...) and never
branches on a launcher itself: read from the code with ``ast``, no module outside ``runner/launchers/``
compares anything with a launcher's word or a ``Launcher`` member, spells a name of a launcher's
environment contract (the table's own names, or one of the prefixes MPI and torchrun use), or holds
a template that compares with a launcher's word. Docstrings are words for people and are not read.
``ALLOWED`` is the short list of what may stay, each with its reason.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import airflow_provider_horovod
from airflow_provider_horovod.runner import launchers
from airflow_provider_horovod.runner.launchers import LAUNCHERS, Launcher

PACKAGE = Path(airflow_provider_horovod.__file__).parent
LAUNCHERS_DIR = Path(launchers.__file__).parent
INTERFACE = ("serve", "host_env", "warm_env", "missing_programs", "start", "start_local")
WORDS = {str(launcher) for launcher in Launcher}
MEMBERS = {launcher.name for launcher in Launcher}
PREFIXES = ("OMPI_", "PMIX_", "PMI_", "ORTE_", "TORCHELASTIC_")  # MPI's and torchrun's own environment
ALLOWED = {
    # the security allow-list of what of a task's environment reaches its ranks (docs/security.md), by
    # prefix: Open MPI's and PMIx's tuning variables pass under every launcher, as Gloo's and the fabrics' do
    ("runner/names.py", "OMPI_"),
    ("runner/names.py", "PMIX_"),
    ("runner/names.py", "ORTE_"),
}
TEMPLATE_BRANCH = re.compile(r"""[=!]=\s*["'](%s)["']""" % "|".join(sorted(WORDS)))


def contract_names() -> set[str]:
    """Every environment name the table gives a launcher: its contract, its mark, its session folder."""
    out: set[str] = set()
    for facts in LAUNCHERS.values():
        out.update(name for names in facts.contract.values() for name in names)
        out.update(name for name in (facts.mark, facts.session_env) if name)
    return out


def docstrings(tree: ast.AST) -> set[int]:
    """The string statements of ``tree`` (docstrings, and strings standing alone as comments)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def is_launcher(node: ast.AST) -> bool:
    """``"torch"`` or ``Launcher.TORCH``: a launcher named in code."""
    if isinstance(node, ast.Constant):
        return node.value in WORDS
    return isinstance(node, ast.Attribute) and node.attr in MEMBERS and getattr(node.value, "id", None) == "Launcher"


def launcher_facts_in(source: str, where: str) -> list[str]:
    """What ``source`` knows of a launcher outside the table: one line each, ``where:line: what``."""
    tree = ast.parse(source)
    skip, names, found = docstrings(tree), contract_names(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_launcher(side) for side in (node.left, *node.comparators)):
            found.append("%s:%d: compares with a launcher: %s" % (where, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            if (where, text) in ALLOWED:
                continue
            if text in names or text.startswith(PREFIXES):
                found.append("%s:%d: names a launcher's environment: %r" % (where, node.lineno, text))
            elif TEMPLATE_BRANCH.search(text):
                found.append("%s:%d: a template compares with a launcher: %r"
                             % (where, node.lineno, TEMPLATE_BRANCH.search(text).group(0)))
    return found


def outside_the_launchers() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if LAUNCHERS_DIR not in path.parents]


def test_no_module_outside_launchers_knows_a_launcher_but_through_the_table():
    found = [line for path in outside_the_launchers()
             for line in launcher_facts_in(path.read_text(), path.relative_to(PACKAGE).as_posix())]
    assert not found, "launcher facts outside runner/launchers/: ask the table instead:\n" + "\n".join(found)


def test_every_allowed_exception_is_still_there():
    texts = {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in outside_the_launchers()}
    assert [(where, text) for where, text in sorted(ALLOWED) if repr(text)[1:-1] not in texts.get(where, "")] == []


@pytest.mark.parametrize(("source", "what"), [
    ('if launcher == "torch":\n    pass\n', "compares with a launcher"),
    ("if self.launcher != Launcher.MPIRUN:\n    pass\n", "compares with a launcher"),
    ('under_mpirun = "OMPI_COMM_WORLD_RANK" in os.environ\n', "names a launcher's environment"),
    ('RANK_ENV = ("HVDRUNNER_RANK", "RANK")\n', "names a launcher's environment"),
    ('PAGE = """{% elif facts.launcher == "torch" %}no timeline{% endif %}"""\n', "a template compares"),
])
def test_the_scan_sees_a_launcher_branch(source, what):
    found = launcher_facts_in(source, "x.py")
    assert len(found) == 1 and what in found[0], found


def test_the_scan_leaves_docstrings_and_frameworks_alone():
    source = ('def device(framework="torch"):\n    """Under ``launcher="torch"``, OMPI_COMM_WORLD_RANK is unset."""\n'
              '    return framework in ("torch", "tensorflow")\n')
    assert launcher_facts_in(source, "x.py") == []


def test_every_launcher_has_one_entry_and_one_module_with_the_interface():
    assert list(LAUNCHERS) == list(Launcher)
    for launcher, facts in LAUNCHERS.items():
        assert facts.name is launcher
        assert facts.module == "%s.%s" % (launchers.__name__, launcher.value)
        path = LAUNCHERS_DIR / ("%s.py" % launcher.value)
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert set(INTERFACE) <= defined, "%s lacks %s" % (path.name, sorted(set(INTERFACE) - defined))


def test_the_table_is_light_enough_for_every_role():
    code = ("import sys; import airflow_provider_horovod.runner.launchers as t; "
            "print(sorted(m for m in ('torch', 'horovod', 'pyspark', 'tensorflow', 'airflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_table_answers_what_the_rank_and_the_task_read_before():
    """The names each place spelled before the table, asked of it now (this step moves code, decides nothing)."""
    from airflow_provider_horovod import runtime
    from airflow_provider_horovod.runner import names
    from airflow_provider_horovod.runner.rank import horovod_guard

    assert set(horovod_guard.HOROVOD_WORLD_ENV) == {"HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}
    assert names.HOROVOD_RANK_CONTRACT == (
        "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_TIMELINE")
    assert launchers.session_envs() == ("OMPI_MCA_orte_tmpdir_base",)
    assert launchers.forwards_output({"OMPI_COMM_WORLD_RANK": "1"})  # under mpirun: orted's pipe
    assert not launchers.forwards_output({"HOROVOD_RANK": "1"}) and not launchers.forwards_output({"TORCHELASTIC_RUN_ID": "r"})
    assert runtime._CONTRACT["size"] == ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE")
    assert runtime._CONTRACT["hostname"] == ("HOROVOD_HOSTNAME",)
    assert launchers.no_timeline_hint("torch").startswith("profile with torch.profiler")
    assert launchers.no_timeline_hint("mpirun") is None and launchers.no_timeline_hint(None) is None
