"""MLflow tracking from the driver (the Airflow task), never from the ranks: one MLflow run per try.

The connection (``mlflow_conn_id``, any connection type, ``http`` is the natural one):

* **host**: the tracking URI, ``http://mlflow.example.com:5000`` (a schema-less host is
  ``http://`` + host + ``:port``); **login** / **password**: MLflow's basic auth
  (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``);
* extras: ``token`` (a bearer token, ``MLFLOW_TRACKING_TOKEN``), ``experiment`` (the experiment's
  name; else the DAG id), ``insecure_tls`` (``true``: do not verify the server's certificate).

The credentials reach MLflow's client through its own environment variables, which it reads on each
request: they are in the task's ``os.environ`` only while one of our calls to MLflow runs
(``_mlflow_environment``), and no rank, mpirun or orted ever gets an ``MLFLOW_*`` variable (the
allow-list, ``names.passes_to_ranks``). An MLflow
server that cannot be reached, or that fails midway, is a warning in the task log, never a failed try.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseHook

from airflow_provider_horovod.runner.events import RunStatus
from airflow_provider_horovod.runner.messages import Report

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0  # how often kept reports go to MLflow, in one batch
MAX_PENDING = 10_000  # reports waiting for MLflow (a slow server): older ones are dropped beyond this
REQUEST_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # a dead server costs seconds, not minutes
PARAM_TYPES = (str, int, float, bool)
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                  "MLFLOW_TRACKING_INSECURE_TLS")


class MlflowTrackingHook(BaseHook):
    """The MLflow tracking server of an Airflow connection, and MLflow's client for it."""

    conn_name_attr = "mlflow_conn_id"
    hook_name = "MLflow tracking"

    def __init__(self, mlflow_conn_id: str) -> None:
        super().__init__()
        self.mlflow_conn_id = mlflow_conn_id

    def settings(self) -> tuple[str, str | None, dict[str, str]]:
        """(tracking URI, experiment name or None, MLflow's environment for the credentials)."""
        conn = self.get_connection(self.mlflow_conn_id)
        extra = conn.extra_dejson or {}
        host = (conn.host or "").strip()
        if not host:
            raise ValueError("The MLflow connection %r has no host: set it to the tracking URI, e.g. "
                             "http://mlflow.example.com:5000" % self.mlflow_conn_id)
        uri = host if "://" in host else "http://%s%s" % (host, ":%d" % conn.port if conn.port else "")
        env = dict(REQUEST_ENV)
        if conn.login:
            env["MLFLOW_TRACKING_USERNAME"] = conn.login
        if conn.password:
            env["MLFLOW_TRACKING_PASSWORD"] = conn.password
        if extra.get("token"):
            env["MLFLOW_TRACKING_TOKEN"] = str(extra["token"])
        if str(extra.get("insecure_tls", "")).lower() == "true":
            env["MLFLOW_TRACKING_INSECURE_TLS"] = "true"
        return uri, extra.get("experiment") or None, env

    def start_run(self, *, experiment: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> MlflowRun | None:
        """A new MLflow run in ``experiment`` (created when missing); ``None``, with a warning, when
        MLflow's client is missing or the server cannot be reached."""
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            log.warning("mlflow_conn_id=%r is set but MLflow's client is not installed: pip install "
                        "'airflow-provider-horovod[mlflow]'. Training goes on without MLflow.", self.mlflow_conn_id)
            return None
        env: dict[str, str] = {}
        try:
            uri, named, env = self.settings()
            with _mlflow_environment(env):
                client = MlflowClient(tracking_uri=uri)
                name = named or experiment
                found = client.get_experiment_by_name(name)
                experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
                run = client.create_run(experiment_id, tags=dict(tags),
                                        run_name="%s try %s" % (tags.get("task_id"), tags.get("try")))
                client.log_batch(run.info.run_id, params=_params(params))
        except Exception as err:  # noqa: BLE001 - MLflow never fails the training
            log.warning("MLflow (connection %r) cannot be reached; training goes on without it: %s",
                        self.mlflow_conn_id, err)
            return None
        url = "%s/#/experiments/%s/runs/%s" % (uri.rstrip("/"), experiment_id, run.info.run_id)
        log.info("MLflow run %s in experiment %r: %s", run.info.run_id, name, url)
        return MlflowRun(client, run.info.run_id, url, env)


_ENVIRONMENT_LOCK = threading.RLock()


@contextlib.contextmanager
def _mlflow_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` (a connection's credentials and request settings) in ``os.environ`` while inside, and
    no other connection's credentials; afterwards ``os.environ`` is as it was."""
    with _ENVIRONMENT_LOCK:
        before = {name: os.environ.get(name) for name in {*CREDENTIAL_ENV, *env}}
        for name in CREDENTIAL_ENV:
            os.environ.pop(name, None)
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _params(params: Mapping[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    return [Param(str(k), str(v)[:6000]) for k, v in params.items() if isinstance(v, PARAM_TYPES) or v is None]


class MlflowRun:
    """One try's MLflow run: reports are logged from a thread of their own, in batches, so a slow
    server never holds up the channel; the first error is a warning and ends the logging."""

    def __init__(self, client: Any, run_id: str, url: str, env: Mapping[str, str] | None = None) -> None:
        self.client = client
        self._env = dict(env or {})
        self.run_id = run_id
        self.url = url
        self._pending: queue.Queue[Report] = queue.Queue(maxsize=MAX_PENDING)
        self._stop = threading.Event()
        self.failed = False
        self._thread = threading.Thread(target=self._loop, name="hvd-mlflow", daemon=True)
        self._thread.start()

    def __call__(self, report: Report) -> None:
        try:
            self._pending.put_nowait(report)
        except queue.Full:
            pass  # a server this far behind loses reports, never the driver's memory

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        from mlflow.entities import Metric

        batch = []
        while not self._pending.empty():
            report = self._pending.get_nowait()
            batch += [Metric(name, value, int(report.time * 1000), report.step or 0) for name, value in report.metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self._call("log metrics", self.client.log_batch, self.run_id, metrics=batch[start:start + 1000])

    def finish(self, status: str, artifacts: Mapping[str, str | None], attempts: Sequence[Mapping[str, Any]] = ()) -> None:
        """Log the last reports, each of ``artifacts`` (artifact path -> local file or folder) that
        exists, the try's ``attempts`` as tags (``horovod.attempts``, and ``horovod.attempt.<n>``:
        how attempt n ended and why), and end the run with ``status`` (``success``, ``failed``,
        ``cancelled``)."""
        self._stop.set()
        self._thread.join(60)
        tags = {"horovod.attempts": str(len(attempts))} if attempts else {}
        for attempt in attempts:
            text = "%s%s" % (attempt.get("ending") or "?", ": %s" % attempt["cause"] if attempt.get("cause") else "")
            tags["horovod.attempt.%s" % attempt.get("number")] = text[:5000]  # MLflow's limit on a tag's value
        if tags:
            from mlflow.entities import RunTag

            self._call("tag the attempts", self.client.log_batch, self.run_id,
                       tags=[RunTag(k, v) for k, v in tags.items()])
        for target, local in artifacts.items():
            if local and os.path.isdir(local):
                self._call("log " + target, self.client.log_artifacts, self.run_id, local, target)
            elif local and os.path.isfile(local):
                self._call("log " + target, self.client.log_artifact, self.run_id, local, target)
        state = {RunStatus.SUCCESS: "FINISHED", RunStatus.CANCELLED: "KILLED"}.get(status, "FAILED")
        self.failed = False  # ending the run is worth one more try even after a failed batch
        self._call("end the run", self.client.set_terminated, self.run_id, state, int(time.time() * 1000))

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return
        try:
            with _mlflow_environment(self._env):
                fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - MLflow never fails the training
            self.failed = True
            log.warning("MLflow could not %s for run %s; training goes on without it: %s", what, self.run_id, err)
