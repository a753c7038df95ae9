"""Where a run without ``artifact_dir`` keeps what rank 0 committed (``driver/artifact_dir.py``), and
when that folder is kept (``HorovodRunner._keep_or_remove``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.runner.driver.artifact_dir import (
    RUNS_ROOT_ENV,
    holds_something,
    new_run_folder,
    runs_root,
)
from airflow_provider_horovod.runner.driver.runner import HorovodRunner
from airflow_provider_horovod.runner.events import RunReport
from airflow_provider_horovod.runner.records import VERSION_MARKER, Layout, Version


def test_the_runs_root_is_the_env_var_else_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(RUNS_ROOT_ENV, str(tmp_path / "mine"))
    assert runs_root() == tmp_path / "mine"
    monkeypatch.delenv(RUNS_ROOT_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert runs_root() == tmp_path / "cache" / "airflow-provider-horovod" / "runs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runs_root() == tmp_path / "home" / ".cache" / "airflow-provider-horovod" / "runs"


def test_a_run_folder_is_named_by_its_utc_time_and_run_id_and_its_root_is_the_users_alone(monkeypatch, tmp_path):
    monkeypatch.setenv(RUNS_ROOT_ENV, str(tmp_path / "runs"))
    folder = new_run_folder("abc123", now=0.0)
    assert folder == tmp_path / "runs" / "19700101-000000-abc123" and folder.is_dir()
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700


def test_a_runs_root_that_cannot_be_made_fails_before_anything_runs_naming_the_variable(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")  # refused to root too, unlike a folder's mode
    monkeypatch.setenv(RUNS_ROOT_ENV, str(tmp_path / "a-file" / "runs"))
    with pytest.raises(ArtifactError, match="Set HVDRUNNER_RUNS_DIR to a folder this process can write, or pass "
                                            "artifact_dir="):
        new_run_folder("abc123")


def _version(folder: Path, seq: int) -> None:
    path = Layout(folder).version(seq)
    path.mkdir(parents=True)
    (path / "step.txt").write_text(str(seq))
    version = Version(seq=seq, step=seq, time=0.0, size=1, files=(("step.txt", 1),), sent=("step.txt",), metrics={})
    (path / VERSION_MARKER).write_text(json.dumps(version.to_json()))


@pytest.mark.parametrize("left", ["version", "checkpoint", "timeline"])
def test_a_run_folder_holding_a_version_a_checkpoint_or_a_timeline_is_kept_and_named(tmp_path, capsys, caplog, left):
    folder = tmp_path / "20261206-000000-abc123"
    (folder / "checkpoints").mkdir(parents=True)
    if left == "version":
        _version(folder, 1)
    elif left == "checkpoint":
        (folder / "checkpoints" / "model.pt").write_bytes(b"weights")
    else:
        (folder / "timeline.json").write_text("[]")
    report = RunReport(run_id="abc123", np=2, launcher="gloo", artifact_dir=str(folder))
    HorovodRunner._keep_or_remove(folder, report)
    assert folder.is_dir() and report.artifact_dir == str(folder)
    said = capsys.readouterr().out + caplog.text  # the log where it shows INFO lines, else stdout
    assert "Run abc123 kept its checkpoints in %s" % folder in said


def test_a_run_folder_rank_0_left_nothing_in_is_removed(tmp_path, capsys, caplog):
    folder = tmp_path / "20261206-000000-abc123"
    (folder / "checkpoints").mkdir(parents=True)  # rank 0's folder came back empty
    (folder / "_RUN.json").write_text("{}")
    (folder / "versions").mkdir()  # no version was committed in it
    report = RunReport(run_id="abc123", np=2, launcher="gloo", artifact_dir=str(folder))
    assert not holds_something(folder)
    HorovodRunner._keep_or_remove(folder, report)
    assert not folder.exists() and report.artifact_dir is None
    assert "kept" not in capsys.readouterr().out + caplog.text
