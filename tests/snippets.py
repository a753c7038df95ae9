"""The code blocks of the README and the docs, as the Markdown has them (the snippet tests run them)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
HOW_TO = REPO / "docs" / "how-to.md"
MIGRATING = REPO / "docs" / "migrating.md"
FIRST_DAG = REPO / "docs" / "first-dag.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
SECTION = re.compile(r"^## (.+)$", re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    section: str  # the heading of the ``##`` section it is in ("" before the first)
    lang: str
    code: str


def blocks(path: Path, lang: str | None = None) -> list[Block]:
    """Every fenced block of ``path`` (of language ``lang``, if given), in order."""
    text = path.read_text()
    sections = [(m.start(), m.group(1).strip()) for m in SECTION.finditer(text)]
    found = []
    for m in FENCE.finditer(text):
        section = next((name for start, name in reversed(sections) if start < m.start()), "")
        if lang is None or m.group(1) == lang:
            found.append(Block(section, m.group(1), m.group(2)))
    return found


def section_code(path: Path, section_start: str) -> list[str]:
    """The Python blocks of the section whose heading starts with ``section_start``."""
    return [b.code for b in blocks(path, "python") if b.section.startswith(section_start)]


def files(path: Path) -> dict[str, str]:
    """The Python blocks of ``path`` that are files: each starts with its path as a comment
    (``# dags/first_model.py``); path -> code."""
    found = {}
    for block in blocks(path, "python"):
        first = block.code.split("\n", 1)[0]
        if first.startswith("# ") and first.endswith(".py") and " " not in first[2:]:
            found[first[2:]] = block.code
    return found
