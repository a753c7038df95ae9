"""``hvd.init()`` is refused in a rank started with torchrun's contract (``launcher="torch"``), where Horovod
would make every rank a world of one; under Horovod's own launchers it is untouched.

The checks with Horovod run in a subprocess, as a rank would: the guard patches Horovod's classes for the
life of the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from airflow_provider_horovod.runner.rank import horovod_guard

CHECKS = r"""
import json
import sys

from airflow_provider_horovod.exceptions import WrongLauncherError
from airflow_provider_horovod.runner.rank import horovod_guard

if sys.argv[1] == "before":  # Horovod imported before install() (a process that imported the stack first)
    import horovod.torch as hvd
horovod_guard.install()
import horovod.torch as hvd

try:
    hvd.init()
    seen = {"size": hvd.size()}
except WrongLauncherError as err:
    seen = {"refused": str(err)}
print(json.dumps(seen))
"""

TORCH_CONTRACT = {"TORCHELASTIC_RUN_ID": "run", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29500"}


def _run(env: dict[str, str], when: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", CHECKS, when], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("env", "under_torch"), [
    (TORCH_CONTRACT, True),
    ({**TORCH_CONTRACT, "HOROVOD_RANK": "1"}, False),  # the Gloo launcher's contract
    ({**TORCH_CONTRACT, "OMPI_COMM_WORLD_RANK": "1"}, False),  # mpirun's
    ({"RANK": "1", "WORLD_SIZE": "2"}, False),  # no torchrun
])
def test_only_a_rank_with_torchruns_contract_and_no_horovod_world_counts_as_under_torch(env, under_torch):
    assert horovod_guard.under_torch_contract(env) is under_torch


@pytest.mark.parametrize("when", ["before", "after"])
def test_hvd_init_under_the_torch_contract_raises_naming_both_fixes(when):
    seen = _run(TORCH_CONTRACT, when)
    message = seen.get("refused", "")
    assert message.startswith('hvd.init() was called in a rank started with launcher="torch" (rank 1 of 2)'), seen
    assert "every rank a world of one" in message
    assert 'launcher="gloo" or launcher="mpirun"' in message and "dist.init_process_group()" in message


def test_hvd_init_outside_the_torch_contract_is_untouched():
    assert _run({}, "after") == {"size": 1}  # a plain process: Horovod's world of one, as the user asked


def test_installing_the_guard_outside_the_torch_contract_changes_nothing(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = list(sys.meta_path)
    horovod_guard.install()
    assert sys.meta_path == before
