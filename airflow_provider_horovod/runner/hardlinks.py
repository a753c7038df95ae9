"""A file shared by a hard link where the file system allows one, else copied: the one helper for
every place that keeps a second name of a file that is never written again (a commit's snapshot on
rank 0's task, a committed version on the driver, a restart's view of it, a version staged for
the store). A link fails across file systems (``EXDEV``) and on file systems without hard links;
the caller chooses the copy (``shutil.copy2`` keeps times and mode, ``shutil.copyfile`` only
the bytes)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

Copy = Callable[[str | os.PathLike[str], str | os.PathLike[str]], object]


def link_or_copy(source: str | os.PathLike[str], target: str | os.PathLike[str], *, copy: Copy = shutil.copy2) -> None:
    """``target`` as a hard link of ``source``; where the file system refuses it, ``copy(source, target)``."""
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        copy(source, target)


def link_tree(source: Path, target: Path, rels: Iterable[str], *, copy: Copy = shutil.copy2) -> None:
    """``target/rel`` for each of ``rels`` as a hard link of ``source/rel`` (``link_or_copy``), its folders made."""
    for rel in rels:
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(source / rel, dest, copy=copy)
