"""Virtualenvs the suite makes with uv and keeps in the cache, outside the repository, so a new
clone on the same machine makes none of them again: the light install's and the lowest versions'.

Each is made once per key (the files that decide what it holds, the base Python and uv), with its
bytecode compiled (this machine sets ``PYTHONDONTWRITEBYTECODE``: without it every process started
in it compiles Airflow and PySpark again, 10 s and more each), and used under a lock, as the run
that holds it rewrites what points into the running checkout.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("AIRFLOW_PROVIDER_HOROVOD_CACHE", Path.home() / ".cache" / "airflow-provider-horovod"))
UV = str(Path(sys.executable).with_name("uv"))
MADE = ".made-by-the-suite"  # written last: a venv without it was cut off while being made


def uv_env() -> dict[str, str]:
    return {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv")}


def uv_install(python: Path, *args: str) -> None:
    """``uv pip install`` into ``python``'s venv, offline first: uv's cache is complete after one run,
    and offline it never revalidates (the index's answers can change between runs, which would make
    it download and build PySpark again)."""
    install = [UV, "pip", "install", "-q", "--python", str(python), *args]
    if subprocess.run([*install, "--offline"], env=uv_env(), capture_output=True, timeout=600).returncode != 0:
        subprocess.run(install, check=True, env=uv_env(), timeout=900)


@contextlib.contextmanager
def cached_venv(name: str, keyed_by: list[bytes], make: Callable[[Path], None]) -> Iterator[Path]:
    """The venv ``CACHE/<name>-<key>``, made by ``make(its python)`` the first time; yields its python."""
    uv_version = subprocess.run([UV, "--version"], check=True, capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([*keyed_by, sys.base_prefix.encode(), sys.version.encode(),
                                     uv_version.encode()])).hexdigest()[:12]
    where = CACHE / ("%s-%s" % (name, key))
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ("%s.lock" % name), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = where / "bin" / "python"
        if not (where / MADE).exists():  # never made, or cut off while being made
            shutil.rmtree(where, ignore_errors=True)
            subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(where)], check=True, env=uv_env(),
                           timeout=120)
            make(python)
            (where / MADE).write_text(uv_version)
        yield python
