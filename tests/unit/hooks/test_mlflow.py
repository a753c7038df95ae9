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


def test_the_credentials_reach_the_server_and_leave_no_trace_in_the_tasks_environment(monkeypatch):
    """Issue 40, T4-12: MLflow's client reads them from os.environ on each request; they are there
    only during our calls, so nothing started later (an np < 0 rank) and nothing after the run sees them."""
    import base64
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from airflow_provider_horovod.hooks.mlflow import CREDENTIAL_ENV

    pytest.importorskip("mlflow")
    seen = []

    class Refusing(BaseHTTPRequestHandler):  # records what MLflow's client sent, then refuses (400)
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": "refused"}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_AUTH", json.dumps({
        "conn_type": "http", "host": "http://127.0.0.1:%d" % server.server_port, "login": "ana", "password": "pw",
        "extra": {"insecure_tls": "true"}}))
    try:
        assert MlflowTrackingHook("mlflow_auth").start_run(experiment="e", tags={}, params={}) is None
    finally:
        server.shutdown()
    assert seen and seen[0] == "Basic " + base64.b64encode(b"ana:pw").decode()  # used while our call ran
    assert [name for name in CREDENTIAL_ENV if name in os.environ] == []  # the review: left in os.environ
