"""HorovodRunnerHook: an Airflow Spark connection -> a SparkSession, the engine, the artifact store.

.. seealso:: ``docs/how-to.md`` (the how-to for HorovodRunnerOperator and ``@task.horovod``)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import re
import shlex
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from airflow.sdk import BaseHook, ObjectStoragePath

from airflow_provider_horovod import store
from airflow_provider_horovod.exceptions import ArtifactError, ArtifactSettingsError
from airflow_provider_horovod.runner.messages import TransferError, safe_relative
from airflow_provider_horovod.runner.driver.executors import python_conf
from airflow_provider_horovod.runner.options import Launcher

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from airflow.sdk import Connection

    from airflow_provider_horovod.runner.events import RunReport

EMBEDDED_MASTER = "local[2]"
MASTER_PATTERN = re.compile(r"^(local(\[(\d+|\*)(,\s*\d+)?\])?|local-cluster\[[\d,\s]+\]|yarn|spark://.+|k8s://.+)$")
# The embedded Spark lives inside the task: no UI for other local users to kill its job from, and
# nothing listening beyond loopback (``spark_conf`` may still say otherwise).
EMBEDDED_CONF = {"spark.ui.enabled": "false", "spark.ui.killEnabled": "false", "spark.driver.host": "127.0.0.1",
                 "spark.driver.bindAddress": "127.0.0.1"}
# Extras of the ``spark`` connection that only mean something to spark-submit.
SPARK_SUBMIT_ONLY_EXTRAS = ("spark-binary", "rest-scheme", "rest-port", "yarn_resourcemanager_webapp_address")
# Extras of the Spark provider's ``spark`` connection that cannot work when the driver runs in the task.
REFUSED_EXTRAS = {
    "keytab": "spark-submit's base64 keytab, which this provider does not write out. The Spark driver runs inside "
              "the Airflow task: give the path of the keytab on the Airflow worker as the extra "
              "'spark.kerberos.keytab' (beside 'principal') instead.",
    "spark-home": "the Spark provider refuses it too. This provider runs the pyspark installed beside Airflow: "
                  "remove the extra (set SPARK_HOME in the worker's environment if you need another Spark).",
}
# The extra of a ``spark`` connection that names its Spark History Server (the "Spark UI" link goes there).
HISTORY_SERVER_EXTRA = "history_server_url"
# The extra of a ``spark`` or ``spark_connect`` connection that bounds, in seconds, the wait for its
# master (``spark://``), Kubernetes API server (``k8s://``) or Spark Connect server to accept a TCP
# connection, checked before any JVM starts. Spark's own standalone client gives up after 3 x 20 s.
CONNECT_TIMEOUT_EXTRA = "connect_timeout"
CONNECT_TIMEOUT_S = 10.0
# Extras of the ``spark`` connection that map onto Spark conf keys.
EXTRA_TO_CONF = {
    "queue": "spark.yarn.queue",
    "namespace": "spark.kubernetes.namespace",
    "principal": "spark.kerberos.principal",
}


_CREATED: dict[str, Any] = {}  # the classic SparkSession a hook of this process created last, and its conf


# Artifact roots: the schemes that are local folders, and what makes the others work.
LOCAL_SCHEMES = ("file", "local")
# A scheme followed by one slash or none ("s3:/bucket/x", "s3:bucket"): a URL written wrong, which would
# otherwise be a local folder named "s3:" under AIRFLOW_HOME.
MALFORMED_ROOT = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)")
FILESYSTEM_EXTRAS = {
    "s3": "Install the s3 extra: pip install \"airflow-provider-horovod[s3]\" (Airflow's Amazon provider with s3fs).",
    "gs": "Install Airflow's Google provider with gcsfs: pip install \"apache-airflow-providers-google\" gcsfs.",
    "gcs": "Install Airflow's Google provider with gcsfs: pip install \"apache-airflow-providers-google\" gcsfs.",
    "abfs": "Install Airflow's Microsoft Azure provider with adlfs: pip install "
            "\"apache-airflow-providers-microsoft-azure\" adlfs.",
}
FILESYSTEM_MODULES = {"s3": ("s3fs",), "gs": ("gcsfs",), "gcs": ("gcsfs",), "abfs": ("adlfs",)}


def check_root_syntax(root: str, what: str = "artifact_root") -> None:
    """A root that looks like a URL must be one (``scheme://...``); ``ArtifactSettingsError`` naming the fix otherwise.
    A pure check: it runs when a DAG is parsed too."""
    found = MALFORMED_ROOT.match(root.strip())
    if found is None or len(found.group(1)) < 2:  # "C:..." is no scheme this provider knows either, but a path
        return
    scheme, rest = found.group(1), root.strip()[found.end():].lstrip("/")
    meant = ("%s:///%s" if scheme.lower() in LOCAL_SCHEMES else "%s://%s") % (scheme, rest)
    raise ArtifactSettingsError(
        "%s %r is not a URL: a scheme needs two slashes (%s), and as it is the artifacts would go to a local "
        "folder named %r. Write %s, or an absolute path (/data/horovod) for a local folder."
        % (what, root, meant, scheme + ":", meant))


def _without_password(root: str) -> str:
    """``root`` for a message: a password in its user info (``s3://key:secret@bucket``) is not repeated."""
    parts = urlsplit(root)
    if parts.password is None:
        return root
    return root.replace(":%s@" % parts.password, ":***@", 1)


PYTHON_KILL_TIMEOUT = "spark.python.task.killTimeout"
PYTHON_KILL_TIMEOUT_S = "500ms"  # the sessions this hook builds (a connection's conf may set its own)


class SparkConnectionError(ValueError):
    """An Airflow Spark connection cannot give a SparkSession for Horovod; the message says how to fix it."""


@dataclass
class SparkTarget:
    """Where the driver's SparkSession goes: a master URL (classic) or an ``sc://`` URL (Spark Connect)."""

    conn_id: str
    master: str | None = None
    remote: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    embedded_fallback: bool = False
    history_server_url: str | None = None
    connect_timeout: float = CONNECT_TIMEOUT_S

    @property
    def location(self) -> str:
        """The target without credentials, for logs."""
        if self.remote:
            return self.remote.split(";", 1)[0].rstrip("/")
        return str(self.master)

    def described(self) -> str:
        """The connection and where it points, for errors."""
        if self.embedded_fallback:
            return "the embedded Spark (master %s; no %r connection is defined)" % (self.location, self.conn_id)
        return "connection %r (%s %s)" % (self.conn_id, "Spark Connect URL" if self.remote else "master", self.location)


class HorovodRunnerHook(BaseHook):
    """
    Run Horovod jobs on the Spark cluster of an Airflow connection and store their artifacts.

    The connection is one of the ``apache.spark`` provider's types, reused as they are:

    * ``spark``: ``host`` holds the master URL (``local[N]``, ``spark://host:7077``, ``yarn``,
      ``k8s://https://host:443``); extras whose keys start with ``spark.`` become Spark conf, and
      ``queue``, ``namespace``, ``principal`` map to their Spark conf keys. ``deploy-mode`` must be
      ``client``: the Spark driver runs inside the Airflow task.
    * ``spark_connect``: ``sc://host:port``, with the token in the password field.

    Either type may set the extra ``connect_timeout`` (seconds, 10 by default): before its JVM starts, the
    task checks that the master (``spark://``, every standby master at once), the Kubernetes API server
    (``k8s://``) or the Spark Connect server accepts a TCP connection within it, and otherwise fails with a
    ``SparkConnectionError`` naming the connection, the master and the fix (``local[N]`` and ``yarn`` have
    nothing to probe: no master process, and a ResourceManager known only to the Hadoop configuration).

    Either type may name its Spark History Server in the extra ``history_server_url``
    (``https://history.example.com:18080``); with ``spark.eventLog.enabled`` the task's "Spark UI"
    link points at the application there, where it outlives the task.

    When the default connection ``spark_default`` does not exist, the hook runs an embedded
    ``local[2]`` Spark inside the task, so example DAGs run with no setup.

    :param spark_conn_id: the Airflow connection of the Spark cluster.
    :param spark_conf: Spark conf that overrides the connection's extras.
    :param app_name: the Spark application name (defaults to ``airflow-horovod``).
    """

    conn_name_attr = "spark_conn_id"
    default_conn_name = "spark_default"
    hook_name = "Horovod on Spark"

    def __init__(
        self,
        spark_conn_id: str = default_conn_name,
        *,
        spark_conf: dict[str, Any] | None = None,
        app_name: str | None = None,
    ) -> None:
        super().__init__()
        self.spark_conn_id = spark_conn_id
        self.spark_conf = dict(spark_conf or {})
        self.app_name = app_name or "airflow-horovod"
        self._session: Any = None
        self._owns_session = False
        self._runner: Any = None
        self._target: SparkTarget | None = None
        self.last_run: RunReport | None = None  # the engine's typed report of the latest run

    # -- connection -> SparkSession ---------------------------------------------------------------
    def resolve_target(self) -> SparkTarget:
        """Read the connection and say where the SparkSession goes; no Spark is started."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = self.get_connection(self.spark_conn_id)
        except AirflowNotFoundException:
            if self.spark_conn_id != self.default_conn_name:
                raise
            self.log.info(
                "No %r connection is defined: running an embedded Spark (%s) inside this task. "
                "Define %r (type spark or spark_connect) to use a cluster.",
                self.spark_conn_id, EMBEDDED_MASTER, self.spark_conn_id,
            )
            target = SparkTarget(conn_id=self.spark_conn_id, master=EMBEDDED_MASTER, conf=dict(EMBEDDED_CONF),
                                 embedded_fallback=True)
        else:
            target = self._target_from_connection(conn)
        target.conf.update(_conf_values(self.spark_conf, "spark_conf"))
        self._target = target
        return target

    def _target_from_connection(self, conn: Connection) -> SparkTarget:
        extras = _extras(conn)
        if conn.conn_type == "spark_connect":
            from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

            self._mask(conn)
            url = SparkConnectHook(conn.conn_id).get_connection_url()
            return SparkTarget(conn_id=conn.conn_id, remote=url, history_server_url=_history_server(conn.conn_id, extras),
                               connect_timeout=_connect_timeout(conn.conn_id, extras))
        if conn.conn_type != "spark":
            raise SparkConnectionError(
                "Connection %r has type %r; HorovodRunnerHook needs a 'spark' connection (host = master URL) "
                "or a 'spark_connect' connection (sc://host:port)." % (conn.conn_id, conn.conn_type)
            )
        return SparkTarget(conn_id=conn.conn_id, master=_master_url(conn), conf=self._conf_from_extras(conn.conn_id, extras),
                           history_server_url=_history_server(conn.conn_id, extras),
                           connect_timeout=_connect_timeout(conn.conn_id, extras))

    def _conf_from_extras(self, conn_id: str, extras: dict[str, Any]) -> dict[str, str]:
        conf: dict[str, str] = {}
        unknown = []
        for key, value in extras.items():
            if key == "deploy-mode":
                if str(value).lower() not in ("client", ""):
                    raise SparkConnectionError(
                        "Connection %r sets deploy-mode=%r, but the Spark driver runs inside the Airflow task, "
                        "so only client mode can work: remove deploy-mode from the connection's extras or set "
                        "it to 'client'." % (conn_id, value)
                    )
            elif key in (HISTORY_SERVER_EXTRA, CONNECT_TIMEOUT_EXTRA):
                continue  # read by resolve_target, not Spark conf
            elif key in SPARK_SUBMIT_ONLY_EXTRAS:
                self.log.info("Ignoring extra %r of connection %r: it only concerns spark-submit.", key, conn_id)
            elif key in EXTRA_TO_CONF:
                conf[EXTRA_TO_CONF[key]] = _conf_value(value, "extra %r of connection %r" % (key, conn_id))
            elif key.startswith("spark."):
                conf[key] = _conf_value(value, "extra %r of connection %r" % (key, conn_id))
            elif key in REFUSED_EXTRAS:
                raise SparkConnectionError("Connection %r has the extra %r: %s" % (conn_id, key, REFUSED_EXTRAS[key]))
            else:
                unknown.append(key)
        if unknown:
            raise SparkConnectionError(
                "Connection %r has extras HorovodRunnerHook does not understand: %s. Spark conf keys start "
                "with 'spark.' (e.g. {\"spark.executor.memory\": \"4g\"}); the other allowed keys are "
                "deploy-mode, queue, namespace, principal, history_server_url, connect_timeout."
                % (conn_id, ", ".join(sorted(unknown)))
            )
        return conf

    def _mask(self, conn: Connection) -> None:
        from urllib.parse import quote

        from airflow.sdk.log import mask_secret

        if conn.password:
            mask_secret(conn.password)
            mask_secret(quote(conn.password))

    def get_conn(self) -> Any:
        """The SparkSession for this connection, built on first use (never at DAG parse time)."""
        if self._session is not None:
            return self._session
        from pyspark.sql import SparkSession

        target = self.resolve_target()
        builder = SparkSession.builder.appName(self.app_name)
        active = None
        # Spark's console progress bar only garbles the task log; the connection's conf can turn it on.
        # A killed task's Python worker ends after spark.python.task.killTimeout (2 s by default): a
        # restart waits that long for the old stage's slots, though a barrier task's ranks need no
        # grace from Spark (its janitor and warm process end them with the worker).
        conf = {"spark.ui.showConsoleProgress": "false", PYTHON_KILL_TIMEOUT: PYTHON_KILL_TIMEOUT_S, **target.conf}
        if not target.remote:  # a local master's executors run the driver's interpreter, unless told otherwise
            conf.update(python_conf(target.master, conf))
        for key, value in conf.items():
            builder = builder.config(key, value)
        if target.remote:
            builder = builder.remote(target.remote)
            self._owns_session = True
        else:
            check_jvm_conf(conf)  # before an earlier task's session is stopped for this one
            active = self._active_session({**conf, "spark.master": str(target.master)})
            self._owns_session = active is None
            builder = builder.master(target.master)
        self.log.info("Starting a SparkSession on %s (connection %r)", target.location, target.conn_id)
        if target.remote or active is None:
            self._prepare_new_session(target, conf)
        self._session = builder.getOrCreate()
        if not target.remote and active is None:
            _CREATED.update(session=self._session, conf={**conf, "spark.master": str(target.master)})
        return self._session

    def _prepare_new_session(self, target: SparkTarget, conf: dict[str, str]) -> None:
        """Before a new session: its master must accept a connection within ``connect_timeout``, then (classic)
        the JVM must start; either failure is a ``SparkConnectionError`` naming the connection, its master and
        the fix, instead of a py4j stack after Spark's 3 x 20 s or PySpark's bare ``JAVA_GATEWAY_EXITED``."""
        check_reachable(target)
        if target.remote:
            return
        launch = {**conf, "spark.master": str(target.master), "spark.app.name": self.app_name}
        if _JVM_LAUNCH.get("conf") is not None:  # an earlier task of this process started the JVM
            reuse_jvm(launch, self.log)
            return
        try:
            start_jvm(launch, JVM_LOG)
        except GatewayExitedError as err:
            raise SparkConnectionError(gateway_exited_message(target, err.lines)) from None

    def _active_session(self, wanted: dict[str, str]) -> Any:
        """The process's active classic SparkSession, to reuse; ``None`` when there is none, or when a
        hook of this process created it (an earlier task under ``airflow dags test``) with other Spark
        conf than this task's: that session is stopped, so this task's conf takes effect (Spark's
        ``getOrCreate`` would keep the first task's SparkContext and drop every other setting)."""
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is None or active is not _CREATED.get("session"):
            return active  # the user's own session (a notebook, a test): theirs to configure
        created = _CREATED["conf"]
        differ = sorted(k for k in set(wanted) | set(created) if wanted.get(k) != created.get(k))
        if not differ:
            return active
        self.log.info("The SparkSession an earlier task of this process started has other Spark conf (%s): "
                      "stopping it and starting this task's own.", ", ".join(differ))
        active.stop()
        _CREATED.clear()
        return None

    def stop_session(self) -> None:
        """Stop the SparkSession if this hook started it."""
        if self._session is not None and self._owns_session:
            with contextlib.suppress(Exception):
                self._session.stop()
        self._session = None

    def history_server_url(self, session: Any) -> str | None:
        """The application's page on the connection's Spark History Server, or ``None``.

        ``None`` when the connection names no ``history_server_url``, or when the session does not
        write an event log (``spark.eventLog.enabled``): the History Server would never show it.
        """
        target = self._target  # what get_conn() resolved
        if target is None or not target.history_server_url:
            return None
        enabled = app_id = None
        with contextlib.suppress(Exception):
            enabled = str(session.conf.get("spark.eventLog.enabled", "false")).lower()
        if enabled != "true":
            self.log.warning(
                "Connection %r names a Spark History Server, but spark.eventLog.enabled is not true: the "
                "application will not appear there, so the task gets no Spark UI link. Set "
                "spark.eventLog.enabled=true and spark.eventLog.dir (the History Server's log directory).",
                target.conn_id,
            )
            return None
        with contextlib.suppress(Exception):
            app_id = session.sparkContext.applicationId
        if not app_id:  # Spark Connect: no SparkContext on the client
            with contextlib.suppress(Exception):
                app_id = session.conf.get("spark.app.id", None)
        if not app_id:
            return None
        return "%s/history/%s/jobs/" % (target.history_server_url.rstrip("/"), quote(str(app_id), safe=""))

    # -- the engine ------------------------------------------------------------------------------
    def run(
        self,
        training_callable: Callable[..., Any] | str,
        *,
        np: int,
        op_args: list[Any] | tuple[Any, ...] = (),
        op_kwargs: dict[str, Any] | None = None,
        **runner_kwargs: Any,
    ) -> tuple[Any, RunReport]:
        """Run ``training_callable(*op_args, **op_kwargs)`` on ``np`` ranks; return (result, the engine's report).

        :param runner_kwargs: passed on to ``HorovodRunner`` (launcher, timeline, artifact_dir, ...).
        """
        from airflow_provider_horovod import HorovodRunner

        runner = HorovodRunner(np, spark=self.get_conn() if np > 0 else None, **runner_kwargs)
        self._runner = runner
        try:
            result = runner.run(training_callable, *op_args, **(op_kwargs or {}))
        finally:
            self._runner = None
            self.last_run = runner.last_run
        return result, self.last_run

    @staticmethod
    def check_job(training_callable: Callable[..., Any] | str, op_args: Any = (), op_kwargs: Any = None, *,
                  launcher: str = Launcher.MPIRUN) -> None:
        """Fail before anything starts (Spark included) when this Python cannot run ``launcher``: no
        Horovod, or one built without it or without a framework (``TrainingStackError``, naming the
        install command); or when the job cannot be shipped: a reference string that does not import,
        an unpicklable closure or arguments that do not fit the signature (``PayloadError``)."""
        from airflow_provider_horovod.runner.environment import require_training_stack
        from airflow_provider_horovod.runner.payload import build_payload

        require_training_stack(Launcher(launcher))
        build_payload(training_callable, tuple(op_args or ()), dict(op_kwargs or {}))

    def cancel(self) -> None:
        """Cancel the running job, if any: the Spark job is interrupted and every rank process killed."""
        runner = self._runner
        if runner is not None:
            runner.cancel()

    # -- artifacts -------------------------------------------------------------------------------
    @staticmethod
    def _airflow_home() -> str:
        from airflow.sdk import conf

        home = conf.get("core", "airflow_home", fallback=None) or os.environ.get("AIRFLOW_HOME") or "~/airflow"
        return os.path.expanduser(home)

    @classmethod
    def artifact_root(cls, value: str | None = None) -> str:
        """``value`` (the operator's ``artifact_root``), else ``[horovod] artifact_root``, else
        ``$AIRFLOW_HOME/horovod-artifacts``; a relative local path is taken under ``$AIRFLOW_HOME``,
        where the worker and the Horovod view both look, never under a process's current folder."""
        return cls._absolute(str(value or "").strip() or cls.default_artifact_root())

    @classmethod
    def default_artifact_root(cls) -> str:
        """``[horovod] artifact_root``, else ``$AIRFLOW_HOME/horovod-artifacts``."""
        from airflow.sdk import conf

        root = (conf.get("horovod", "artifact_root", fallback="") or "").strip()
        return cls._absolute(root or "horovod-artifacts")

    @classmethod
    def _absolute(cls, root: str) -> str:
        check_root_syntax(root)
        if "://" in root or os.path.isabs(os.path.expanduser(root)):
            return root
        return os.path.join(cls._airflow_home(), root)

    @classmethod
    def check_artifact_root(cls, root: str) -> None:
        """Before Spark starts: ``root``'s file system is installed and the connection it names is defined;
        else an ``ArtifactSettingsError`` that names the missing extra or connection (instead of a write probe that
        fails seconds later and reads like an endpoint or IAM problem)."""
        check_root_syntax(root)
        parts = urlsplit(root) if "://" in root else None
        if parts is None or parts.scheme in LOCAL_SCHEMES:
            return
        from airflow.sdk.io.fs import has_fs

        install = FILESYSTEM_EXTRAS.get(parts.scheme)
        missing = [module for module in FILESYSTEM_MODULES.get(parts.scheme, ())
                   if importlib.util.find_spec(module) is None]
        if not has_fs(parts.scheme) or missing:
            raise ArtifactSettingsError(
                "The artifact root %s needs a file system for %s://, which is not installed in this Airflow worker's "
                "Python%s. %s No Spark was started." % (
                    _without_password(root), parts.scheme, " (%s cannot be imported)" % ", ".join(missing) if missing else "",
                    install or "Check the scheme's spelling (file://, s3://, gs://, abfs://), or install the Airflow "
                               "provider that registers a file system for it."))
        conn_id = parts.username
        if conn_id:
            cls._require_connection(root, conn_id)

    @classmethod
    def _require_connection(cls, root: str, conn_id: str) -> None:
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            raise ArtifactSettingsError(
                "The artifact root %s names the Airflow connection %r, which is not defined here. Define it (e.g. "
                "airflow connections add %s --conn-type aws ..., or AIRFLOW_CONN_%s in the worker's environment) or "
                "fix the name in the URL (scheme://<conn_id>@<bucket>/<prefix>). No Spark was started."
                % (_without_password(root), conn_id, conn_id, conn_id.upper())) from None

    @classmethod
    def resume_roots(cls, artifact_root: str | None) -> list[str]:
        """Where a ``resume`` URI may point: the task's artifact root (or the default) and
        ``[horovod] resume_extra_roots`` (comma-separated)."""
        return [cls.artifact_root(artifact_root), *cls.configured_roots("resume_extra_roots")]

    @classmethod
    def configured_roots(cls, option: str) -> list[str]:
        """The roots a ``[horovod]`` option lists, comma-separated (``resume_extra_roots``, ``view_extra_roots``)."""
        from airflow.sdk import conf

        value = conf.get("horovod", option, fallback="") or ""
        return [cls._absolute(root.strip()) for root in value.split(",") if root.strip()]

    def download(self, source: ObjectStoragePath | str, prefix: str = "hvd-resume-",
                 files: tuple[str, ...] | None = None) -> str:
        """Copy a stored checkpoint folder (or file) to a new local temporary folder; return its path.

        ``files``: the files its marker names (``store.Checkpoint.files``), the only ones copied;
        without it, every file below ``source`` (a folder a user named).
        Every file lands inside that folder: a name that would leave it is an ``ArtifactError``,
        and links in a local store are not followed.
        """
        src = store.storage_path(source) if isinstance(source, str) else source
        if files is None and not src.exists():
            raise ArtifactError("Cannot resume from %s: it does not exist." % src)
        local = Path(tempfile.mkdtemp(prefix=prefix))
        try:
            if files is not None:
                for name in files:
                    try:
                        rel = safe_relative(name)
                        item = src / rel.as_posix()
                        if _is_link(item):
                            raise ValueError("a link, never followed")
                        _download(item, local.joinpath(*rel.parts))
                    except (TransferError, ValueError, OSError) as err:
                        raise ArtifactError("Cannot resume from %s: %s (%s)" % (src, name, err)) from None
                return str(local)
            if src.is_file():
                _download(src, local / safe_relative(src.name).as_posix())
                return str(local)
            for item in src.rglob("*"):
                if _is_link(item) or not item.is_file():
                    continue
                try:
                    rel = safe_relative(item.relative_to(src).as_posix())
                except (TransferError, ValueError) as err:
                    raise ArtifactError("Cannot resume from %s: %s" % (src, err)) from None
                _download(item, local.joinpath(*rel.parts))
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        return str(local)


JVM_LOG = logging.getLogger("airflow_provider_horovod.spark")
# log4j's default layout in Spark: "25/12/03 04:10:11 WARN NativeCodeLoader: Unable to load ..."
JVM_LINE = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) ")
# a Java stack trace's lines: its exception ("org.apache.spark.SparkException: ..."), frames, causes
JVM_STACK_LINE = re.compile(r"^(\s+at |\s*\.\.\. \d+ (more|common frames omitted)|Caused by: |\s+Suppressed: |"
                            r"([a-z_$][\w$]*\.)+[A-Z][\w$]*(Exception|Error|Throwable)(: |$))")
# a Java stack trace's frames, which say nothing to a user ("\tat ...", "... 12 more")
JVM_FRAME_LINE = re.compile(r"^(\s+at |\s*\.\.\. \d+ (more|common frames omitted))")
JVM_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
              "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def start_jvm(conf: dict[str, str], logger: logging.Logger) -> None:
    """Start this process's Spark JVM (PySpark's gateway) in a session of its own, its stdout and
    stderr going to ``logger`` line by line, each at the level log4j gave it. Nothing to do when
    this process has its JVM already (PySpark starts one per process and keeps it).

    A session of its own: Airflow stops a task ("mark failed", SIGTERM) by signalling the task's
    whole process group. A JVM in that group would shut its executors down at once and race the
    provider's graceful cancel, which hands rank 0's checkpoint over first. Out of the group, the
    JVM still ends with this process: PySpark's gateway exits when its stdin pipe closes.

    The JVM writes into an unlinked temporary file that a daemon thread follows: a file never
    blocks the JVM and never breaks under it when this process dies, as a pipe would.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.errors import PySparkRuntimeError
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:
        return
    _JVM_LAUNCH["conf"] = dict(conf)
    fd, path = tempfile.mkstemp(prefix="hvd-jvm-", suffix=".log")
    try:
        read_fd = os.open(path, os.O_RDONLY)
        os.unlink(path)
        output = _JvmLines(read_fd, logger)
        output.start()
        with _conf_in_private_file(conf):
            gateway = launch_gateway(SparkConf(loadDefaults=False),
                                     popen_kwargs={"stdout": fd, "stderr": fd, "start_new_session": True})
    except PySparkRuntimeError as err:
        _JVM_LAUNCH.clear()
        if err.getCondition() != "JAVA_GATEWAY_EXITED":
            raise
        raise GatewayExitedError(output.finish()) from None
    finally:
        os.close(fd)
    SparkContext._ensure_initialized(gateway=gateway)


# The Spark conf this process's JVM was started with (spark-submit made each key a Java system property,
# which every later SparkContext of the JVM reads as its default); empty until a hook starts the JVM.
_JVM_LAUNCH: dict[str, dict[str, str]] = {}
# Spark conf that takes effect only when the driver's JVM starts: its memory, options and class path (what
# spark-submit resolves into them), and its Kerberos login. A later SparkContext in the same JVM cannot change it.
JVM_LAUNCH_KEYS = frozenset({
    "spark.driver.memory", "spark.driver.extraJavaOptions", "spark.driver.defaultJavaOptions",
    "spark.driver.extraClassPath", "spark.driver.extraLibraryPath", "spark.driver.userClassPathFirst",
    "spark.jars", "spark.jars.packages", "spark.jars.repositories", "spark.jars.excludes", "spark.jars.ivy",
    "spark.jars.ivySettings", "spark.kerberos.keytab", "spark.kerberos.principal",
})


def launch_conflicts(wanted: dict[str, str], launched: dict[str, str]) -> list[str]:
    """The keys of ``wanted`` that cannot take effect in a JVM started with ``launched``: JVM-start keys whose
    value differs (set, changed or unset). A pure function."""
    return sorted(key for key in JVM_LAUNCH_KEYS if wanted.get(key) != launched.get(key))


def check_jvm_conf(conf: dict[str, str]) -> None:
    """When an earlier task of this process started the JVM (``airflow dags test`` runs every task in one
    process): ``SparkConnectionError`` for conf that only a new JVM could apply, naming it and why."""
    launched = _JVM_LAUNCH.get("conf")
    conflicts = [] if launched is None else launch_conflicts(conf, launched)
    if conflicts:
        raise SparkConnectionError(
            "This task's Spark conf cannot take effect: this process's Spark JVM was started by an earlier task, and a "
            "JVM's memory, options and class path are fixed when it starts (%s). This happens when several tasks "
            "run in one process, as under `airflow dags test`; a scheduler runs each task in a process of its own. "
            "Give these tasks the same values (the connection's extras are one place for them), or run the tasks "
            "separately." % "; ".join("%s is %s here, %s in the JVM" % (
                key, _shown(conf.get(key)), _shown(launched.get(key))) for key in conflicts))


def reuse_jvm(conf: dict[str, str], log: logging.Logger) -> None:
    """A new SparkSession in the JVM an earlier task of this process started: the earlier task's conf is
    cleared from the JVM's system properties (where spark-submit put it, and where every new SparkContext
    reads its defaults), so the new session has this task's conf and nothing of the earlier one's. A key
    the earlier task set then has Spark's own default, even where ``spark-defaults.conf`` sets it."""
    from pyspark import SparkContext

    check_jvm_conf(conf)
    launched = _JVM_LAUNCH["conf"]
    stale = sorted(key for key in launched if key not in conf)
    system = SparkContext._jvm.java.lang.System
    for key in stale:
        system.clearProperty(key)
    if stale:
        log.info("Cleared the Spark conf an earlier task of this process started the JVM with (%s): this task's "
                 "session has its own conf only.", ", ".join(stale))
    _JVM_LAUNCH["conf"] = {key: value for key, value in launched.items() if key in conf}


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)


class GatewayExitedError(RuntimeError):
    """spark-submit exited before PySpark's gateway was up; ``lines``: the last lines it printed."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("Spark's JVM exited before its gateway started")
        self.lines = lines


# What the last lines of a spark-submit that exited say, and what to do about it (the first match wins).
GATEWAY_FIXES = (
    (re.compile(r"HADOOP_CONF_DIR or YARN_CONF_DIR"),
     "Set HADOOP_CONF_DIR (or YARN_CONF_DIR) in the Airflow worker's environment to the YARN cluster's client "
     "configuration, or point the connection at another master."),
    (re.compile(r"JAVA_HOME|/bin/java\b|java: (command )?not found|UnsupportedClassVersionError"),
     "Spark 4 needs a Java 17 or newer runtime on the Airflow worker: point JAVA_HOME at one (or unset it to use "
     "the java on PATH), or install one (apt-get install openjdk-17-jre-headless)."),
)
GATEWAY_FIX_OTHERWISE = (
    "Fix what spark-submit says: the usual causes are a Spark conf value it rejects (the connection's extras, the "
    "task's spark_conf, spark-defaults.conf), a master URL it cannot use, or the Java runtime (JAVA_HOME, Java 17+). "
    "The JVM's whole output is in the task log (logger airflow_provider_horovod.spark, stack traces at DEBUG).")
# The connection ``airflow connections create-default-connections`` makes: a trap for the embedded default.
DEFAULT_CONNECTION_TRAP = (
    " If %r is the connection that `airflow connections create-default-connections` created (host yarn, extras "
    "{\"queue\": \"root.default\"}), delete it (airflow connections delete %s) to run the embedded local[2] Spark "
    "instead, or point it at your cluster.")


def gateway_exited_message(target: SparkTarget, lines: list[str]) -> str:
    """The error for a spark-submit that exited before the session existed (PySpark's JAVA_GATEWAY_EXITED)."""
    said = "\n".join("  %s" % line for line in lines) or "  (nothing)"
    fix = next((fix for pattern, fix in GATEWAY_FIXES if any(pattern.search(line) for line in lines)),
               GATEWAY_FIX_OTHERWISE)
    if target.conn_id == HorovodRunnerHook.default_conn_name and target.master == "yarn" and not target.embedded_fallback:
        fix += DEFAULT_CONNECTION_TRAP % (target.conn_id, target.conn_id)
    return ("Spark's JVM for %s exited before the SparkSession existed (PySpark's JAVA_GATEWAY_EXITED). The last "
            "lines spark-submit printed:\n%s\n%s" % (target.described(), said, fix))


# -- is the master there? (before any JVM starts) --------------------------------------------------
# What answers for each kind of target, the port it listens on by default, and what to do when it does not.
ENDPOINT_KINDS = {
    "spark": ("the Spark master", None,
              "Start the master, or set the connection's host to the URL its web UI shows (spark://host:7077; "
              "with standby masters, all of them: spark://a:7077,b:7077)."),
    "k8s": ("the Kubernetes API server", None,
            "Set the connection's host to the API server's URL as `kubectl cluster-info` prints it "
            "(k8s://https://host:port)."),
    "sc": ("the Spark Connect server", 15002,
           "Start the Spark Connect server (sbin/start-connect-server.sh), or fix the connection's host and port "
           "(sc://host:15002)."),
}


def endpoints(target: SparkTarget) -> tuple[str, list[tuple[str, int]]]:
    """What must accept a TCP connection before a session on ``target`` can exist: (its kind, its addresses).

    ``spark://a:7077,b:7077``: each master (one answering is enough); ``k8s://``: the API server; ``sc://``:
    the Spark Connect server. None for ``local[N]`` (no master process) and ``yarn``, whose ResourceManager's
    address lives in the Hadoop configuration that spark-submit reads (a missing one is its own error).
    """
    where = target.location
    if target.remote:
        return "sc", [_address(target, where, ENDPOINT_KINDS["sc"][1])]
    if where.startswith("spark://"):
        return "spark", [_address(target, "spark://" + part.strip(), None) for part in where[len("spark://"):].split(",")]
    if where.startswith("k8s://"):
        url = where[len("k8s://"):]
        return "k8s", [_address(target, url if "://" in url else "https://" + url, None)]
    return "", []


def _address(target: SparkTarget, url: str, default_port: int | None) -> tuple[str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port or default_port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        port = None
        parts = None
    if parts is None or not parts.hostname or not port:
        raise SparkConnectionError(
            "%s names %r, which has no host and port to connect to. Write it as spark://host:7077, "
            "k8s://https://host:443 or sc://host:15002." % (target.described(), url))
    return parts.hostname, port


def check_reachable(target: SparkTarget) -> None:
    """Raise ``SparkConnectionError`` unless one of ``target``'s endpoints accepts a TCP connection within its
    ``connect_timeout``: before any JVM starts, instead of Spark's 3 x 20 s and a py4j stack (``spark://``) or
    retries for minutes (Spark Connect)."""
    kind, addresses = endpoints(target)
    if not addresses:
        return
    failures = _probe(addresses, target.connect_timeout)
    if failures is None:
        return
    what, _, fix = ENDPOINT_KINDS[kind]
    raise SparkConnectionError(
        "Cannot reach %s of %s within connect_timeout=%g s: %s. No Spark was started. %s The Airflow worker "
        "must reach it over TCP (a firewall that drops packets looks like a timeout); on a slow network raise "
        "the connection's extra %r (seconds)." % (what, target.described(), target.connect_timeout,
                                                  "; ".join(failures), fix, CONNECT_TIMEOUT_EXTRA))


def _probe(addresses: list[tuple[str, int]], timeout: float) -> list[str] | None:
    """``None`` as soon as one address accepts a TCP connection within ``timeout`` (all are tried at once);
    else why each did not."""
    answers: queue.Queue[tuple[tuple[str, int], str | None]] = queue.Queue()
    for address in addresses:
        threading.Thread(target=_connect, args=(address, timeout, answers), name="hvd-master-probe",
                         daemon=True).start()
    deadline = time.monotonic() + timeout
    why: dict[tuple[str, int], str] = {}
    while len(why) < len(addresses):
        try:
            address, failure = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if failure is None:
            return None
        why[address] = failure
    silent = "did not answer within %g s" % timeout
    return ["%s:%d %s" % (host, port, why.get((host, port), silent)) for host, port in addresses]


def _connect(address: tuple[str, int], timeout: float, answers: queue.Queue) -> None:
    try:
        with socket.create_connection(address, timeout=timeout):
            failure = None
    except TimeoutError:
        failure = "did not answer within %g s" % timeout
    except ConnectionRefusedError:
        failure = "refused the connection (nothing listens on that port)"
    except socket.gaierror as err:
        failure = "does not resolve (%s)" % err.strerror
    except OSError as err:
        failure = "cannot be reached (%s)" % (err.strerror or err)
    answers.put((address, failure))


@contextlib.contextmanager
def _conf_in_private_file(conf: dict[str, str]) -> Iterator[None]:
    """spark-submit reads ``conf`` from a file only this user can read (``--properties-file``, with
    ``--load-spark-defaults`` so that ``spark-defaults.conf`` still applies beneath it), never from
    its command line, which every local user sees in ``ps`` (``spark.authenticate.secret``, store
    keys). PySpark's ``launch_gateway`` takes that option only from ``PYSPARK_SUBMIT_ARGS``, read
    while it starts the JVM. The file goes once the JVM is up (SparkSubmit reads it before it opens
    the gateway)."""
    fd, path = tempfile.mkstemp(prefix="hvd-spark-", suffix=".properties")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines("%s=%s\n" % (_escaped_property(key), _escaped_property(value))
                         for key, value in sorted(conf.items()))
        before = os.environ.get("PYSPARK_SUBMIT_ARGS")
        os.environ["PYSPARK_SUBMIT_ARGS"] = "--properties-file %s --load-spark-defaults %s" % (
            shlex.quote(path), before or "pyspark-shell")
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
            else:
                os.environ["PYSPARK_SUBMIT_ARGS"] = before
    finally:
        os.unlink(path)


# Java's Properties.load reads these back as the character itself; Spark reads the file as UTF-8.
_PROPERTY_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f", "=": "\\=",
                     ":": "\\:", " ": "\\ ", "#": "\\#", "!": "\\!"}


def _escaped_property(text: str) -> str:
    """``text`` as a key or value of a Java properties file (Spark trims a value's outer spaces)."""
    return "".join(_PROPERTY_ESCAPES.get(c, c) for c in text)


class _JvmLines(threading.Thread):
    """Follows the JVM's output file and logs each line at its log4j level.

    Java stack traces (exception, frames, causes) go to DEBUG: under a failed run the provider's own
    error says what happened in one line, and 75-100 lines of Spark's frames would bury it. Other
    lines without a level (banners) take the level of the line before them, INFO at first.
    """

    POLL_S = 0.2
    TAIL = 8  # the lines an error quotes when the JVM exits before its gateway started

    def __init__(self, read_fd: int, logger: logging.Logger) -> None:
        super().__init__(name="hvd-jvm-log", daemon=True)
        self._fd = read_fd
        self._logger = logger
        self._level = logging.INFO
        self._tail: deque[str] = deque(maxlen=self.TAIL)
        self._ending = threading.Event()

    def run(self) -> None:
        pending = b""
        try:
            while True:  # for the life of this process (the JVM may write until it ends), or until finish()
                chunk = os.read(self._fd, 1 << 16)
                if not chunk:
                    if self._ending.is_set():
                        break
                    time.sleep(self.POLL_S)
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    self._line(raw.decode("utf-8", errors="replace"))
            self._line(pending.decode("utf-8", errors="replace"))
        finally:
            os.close(self._fd)

    def finish(self, timeout: float = 5.0) -> list[str]:
        """Once the JVM has exited: log the rest of its output, stop, and return its last lines (no frames)."""
        self._ending.set()
        self.join(timeout)
        return list(self._tail)

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        if not JVM_FRAME_LINE.match(line):
            self._tail.append(line.rstrip())
        if JVM_STACK_LINE.match(line):  # the provider's own error says what failed and what to do
            self._logger.debug("%s", line)
            return
        found = JVM_LINE.match(line)
        if found:
            self._level = JVM_LEVELS[found.group(1)]
        elif not line[:1].isspace() and not line.startswith(("Caused by", "...")):
            self._level = logging.INFO
        self._logger.log(self._level, "%s", line)


def _is_link(path: ObjectStoragePath) -> bool:
    try:
        return bool(path.is_symlink())
    except (NotImplementedError, OSError, AttributeError):
        return False  # object stores have no links


def _download(src: ObjectStoragePath, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    if not store.is_local(src):  # streamed in the store's own chunks, not read ahead whole
        src.fs.get_file(src.path, str(local))
        return
    with src.open("rb") as fsrc, local.open("wb") as dst:
        shutil.copyfileobj(fsrc, dst, 1 << 20)


def _extras(conn: Connection) -> dict[str, Any]:
    raw = conn.extra
    if raw in (None, ""):
        return {}
    if isinstance(raw, dict):
        extras: Any = raw
    else:
        try:
            extras = json.loads(raw)
        except ValueError as err:
            raise SparkConnectionError(
                "The extras of connection %r are not valid JSON (%s). Write them as a JSON object, e.g. "
                "{\"spark.executor.memory\": \"4g\"}." % (conn.conn_id, err)
            ) from None
    if not isinstance(extras, dict):
        raise SparkConnectionError(
            "The extras of connection %r must be a JSON object of Spark conf, e.g. {\"spark.executor.memory\": "
            "\"4g\"}; got a JSON %s." % (conn.conn_id, type(extras).__name__)
        )
    return extras


def _history_server(conn_id: str, extras: dict[str, Any]) -> str | None:
    value = extras.get(HISTORY_SERVER_EXTRA)
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not re.match(r"^https?://[^/\s]+", value.strip()):
        raise SparkConnectionError(
            "Extra %r of connection %r must be the http(s) URL of a Spark History Server, e.g. "
            "\"http://history.example.com:18080\"; got %r." % (HISTORY_SERVER_EXTRA, conn_id, value)
        )
    return value.strip().rstrip("/")


def _connect_timeout(conn_id: str, extras: dict[str, Any]) -> float:
    value = extras.get(CONNECT_TIMEOUT_EXTRA)
    if value in (None, ""):
        return CONNECT_TIMEOUT_S
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise SparkConnectionError(
            "Extra %r of connection %r must be a number of seconds above 0 (how long to wait for the master to "
            "accept a connection; %g by default); got %r." % (CONNECT_TIMEOUT_EXTRA, conn_id, CONNECT_TIMEOUT_S, value))
    return seconds


def _master_url(conn: Connection) -> str:
    host = (conn.host or "").strip()
    if not host:
        raise SparkConnectionError(
            "Connection %r has no host. Put the Spark master URL in host: local[N], spark://host:7077, yarn "
            "or k8s://https://host:443." % conn.conn_id
        )
    if "://" in host or not conn.port or host.startswith(("local", "yarn")):
        master = host if not conn.port else "%s:%s" % (host, conn.port)
    else:
        master = "spark://%s:%s" % (host, conn.port)
    if not MASTER_PATTERN.match(master):
        raise SparkConnectionError(
            "Connection %r has master URL %r, which HorovodRunnerHook cannot use. Use local[N], "
            "spark://host:port, yarn or k8s://https://host:port (mesos is gone from Spark 4; for Spark "
            "Connect use a spark_connect connection)." % (conn.conn_id, master)
        )
    return master


def _conf_value(value: Any, what: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise SparkConnectionError("%s must be a string, number or boolean Spark conf value; got %r." % (what, value))


def _conf_values(conf: dict[str, Any], what: str) -> dict[str, str]:
    if not isinstance(conf, dict):
        raise SparkConnectionError("%s must be a dict of Spark conf; got %r." % (what, conf))
    return {str(k): _conf_value(v, "%s[%r]" % (what, k)) for k, v in conf.items()}
