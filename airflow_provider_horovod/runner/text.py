"""Text from the ranks, made safe to show: a line of theirs stays one line of ours.

Rank output, failure messages, tracebacks and mpirun's words reach the Airflow task log. A
newline, a carriage return, an escape sequence or a Unicode line separator in them (sent by a
rank, or printed by the training code) must not start a record of its own there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_CONTROL = {c: "\\x%02x" % c for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c != 0x09}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
INDENT = "  "  # before each line a rank wrote, inside an error's text: none of them starts a line of it


def one_line(line: Any) -> str:
    """``line`` with every control character escaped, so it stays one record of the log."""
    return (line if isinstance(line, str) else str(line)).translate(_CONTROL)


def quoted(lines: Iterable[Any]) -> str:
    """Lines a rank wrote, each escaped and indented, one per line of the result."""
    return "\n".join(INDENT + one_line(line) for line in lines)


def quoted_text(text: str) -> str:
    """A rank's multi-line text (a traceback): each of its lines ``quoted``."""
    return quoted(text.rstrip().split("\n"))
