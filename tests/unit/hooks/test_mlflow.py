"""The MLflow connection's fields, and a server that cannot be reached (no training fails for it)."""

from __future__ import annotations

import json
import logging

import pytest

from airflow_provider_horovod.hooks.mlflow import MlflowTrackingHook
from airflow_provider_horovod.runner.names import is_secret_env


def test_the_connection_gives_the_tracking_uri_experiment_and_credentials_for_the_driver_only(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_X", json.dumps({
        "conn_type": "http", "host": "mlflow.example.com", "port": 5000, "login": "ana", "password": "pw",
        "extra": {"token": "tok", "experiment": "digits", "insecure_tls": "true"}}))
    uri, experiment, env = MlflowTrackingHook("mlflow_x").settings()
    assert (uri, experiment) == ("http://mlflow.example.com:5000", "digits")
    assert {k: env[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                                "MLFLOW_TRACKING_INSECURE_TLS")} == {
        "MLFLOW_TRACKING_USERNAME": "ana", "MLFLOW_TRACKING_PASSWORD": "pw", "MLFLOW_TRACKING_TOKEN": "tok",
        "MLFLOW_TRACKING_INSECURE_TLS": "true"}
    assert is_secret_env("MLFLOW_TRACKING_PASSWORD") and is_secret_env("MLFLOW_TRACKING_TOKEN")  # never a rank's


def test_a_connection_without_a_host_is_a_warning_not_an_error(monkeypatch, caplog):
    """(An unreachable server: tests/integration/test_airflow_dags.py, the ``unreachable`` task.)"""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_EMPTY", json.dumps({"conn_type": "http"}))
    with caplog.at_level(logging.WARNING):
        assert MlflowTrackingHook("mlflow_empty").start_run(experiment="e", tags={}, params={}) is None
    assert "has no host: set it to the tracking URI" in caplog.text
