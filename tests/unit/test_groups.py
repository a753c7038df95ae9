"""The suite's split between xdist workers (tests/groups.py) names only files that exist, and keeps
together what must not be made twice."""

from __future__ import annotations

from pathlib import Path

from tests import groups

REPO = Path(__file__).resolve().parents[2]


def test_every_path_of_the_table_exists_so_no_group_is_silently_empty():
    missing = [(g.name, p) for g in groups.GROUPS for p in g.paths if not (REPO / p).exists()]
    assert missing == []
    assert len(groups.BY_NAME) == len(groups.GROUPS)  # names are unique


def test_files_sharing_a_deployment_or_a_bed_are_one_group_and_other_files_are_their_own():
    deployment = sorted((REPO / "tests/integration/on_deployment").glob("test_*.py"))
    assert len(deployment) >= 2
    assert {groups.group_of("%s::t" % p.relative_to(REPO)).name for p in deployment} == {"deployment"}
    beds = ["tests/integration/test_hosts.py::t", "tests/integration/test_hosts_loopback_names.py::t[mpirun]"]
    assert {groups.group_of(b).name for b in beds} == {"beds"}
    assert groups.group_of("tests/unit/test_store.py::t[a::b]").name == "tests/unit/test_store.py"
