"""mpirun's rsh agent (``launchers/mpirun_rsh.py``): what it says, and where, when it cannot do its job.
Its happy path (an orted started through a host's exec service) runs in every mpirun test."""

from __future__ import annotations

import json

from airflow_provider_horovod.runner import names
from airflow_provider_horovod.runner.launchers import mpirun_rsh


def test_a_call_without_a_command_is_a_usage_error(capsys):
    assert mpirun_rsh._run(["hvdhost1"]) == 2
    assert "usage: hvdrunner-rsh HOST COMMAND" in capsys.readouterr().err


def test_a_host_without_an_exec_service_is_refused_and_said_in_the_task_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(names.ENV_PLAN, str(tmp_path / names.PLAN_FILE))
    monkeypatch.setenv(names.ENV_EXEC_SERVICES, json.dumps({"hvdhost0": "127.0.0.1:1"}))
    assert mpirun_rsh._run(["hvdhost9", "orted", "-mca", "x"]) == 255
    assert "no exec service for host 'hvdhost9' (known: ['hvdhost0'])" in (tmp_path / names.AGENT_LOG).read_text()


def test_an_agent_that_fails_says_why_in_the_log_and_exits_255(tmp_path, monkeypatch):
    monkeypatch.setenv(names.ENV_PLAN, str(tmp_path / names.PLAN_FILE))
    monkeypatch.setenv(names.ENV_EXEC_SERVICES, json.dumps({"hvdhost0": "127.0.0.1:1"}))
    code = None
    try:
        mpirun_rsh.main(["hvdhost0", "orted"])  # no exec key in the folder: the agent cannot authenticate
    except SystemExit as end:
        code = end.code
    assert code == 255
    said = (tmp_path / names.AGENT_LOG).read_text()
    assert "hvdrunner-rsh ['hvdhost0']: FileNotFoundError" in said and "orted ended with 255" in said
