"""HorovodRunnerOperator: run a training callable as a Horovod job on Spark, from an Airflow task."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.definitions._internal.mixins import ResolveMixin

from airflow_provider_horovod import retry, store
from airflow_provider_horovod.exceptions import HorovodRunError
from airflow_provider_horovod.metrics import check_progress_interval
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook, check_root_syntax
from airflow_provider_horovod.recorder import RESUME_AUTO, RESUME_NEVER, TryRecorder, TrySettings, is_json
from airflow_provider_horovod.runner.transfer import Limits
from airflow_provider_horovod.runner.dataset import check_dataset
from airflow_provider_horovod.runner.events import RunReport, RunStatus
from airflow_provider_horovod.runner.options import (
    DEFAULT_KEEP,
    DEFAULT_LAST_CALL_S,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    Launcher,
    check_keep,
    check_last_call,
    check_options,
    check_restarts,
)
from airflow_provider_horovod.runner.payload import check_arguments
from airflow_provider_horovod.links import HorovodTimelineLink, MlflowRunLink, SparkUILink

if TYPE_CHECKING:
    from airflow.sdk import Context

# Metadata of every try, each under its own XCom key too (for @task.horovod, whose return_value is
# the training function's value, and for the UI): ``horovod_<name>``.
METADATA = ("artifacts_uri", "checkpoint_uri", "timeline_uri", "try_number", "duration_s", "metrics", "attempts")
# An executor lost mid-training costs a restart inside the try, at most twice (see max_restarts)
DEFAULT_OPERATOR_RESTARTS = 2
METADATA_XCOM_PREFIX = "horovod_"
SMALL_RESULT_CHARS = 4096  # a result up to this size (as JSON) goes into the asset event extra
NO_CHECKPOINT = "none: rank 0 left runtime.checkpoint_dir() empty"


class HorovodRunnerOperator(BaseOperator):
    """
    Run ``training_callable`` on ``np`` Horovod ranks in one barrier-mode Spark stage.

    Rank logs stream into the task log, tagged by rank. Rank 0's return value and the stored
    artifacts (timeline, rank 0's checkpoints) come back as the ``return_value``
    XCom, a JSON dict with ``result``, ``artifacts_uri``, ``checkpoint_uri``, ``timeline_uri``,
    ``np``, ``launcher``, ``try_number``, ``duration_s``, ``attempts`` (one per barrier stage of the
    try: ``number``, ``np``, ``ending``, ``cause``, ...) and ``metrics`` (rank 0's
    newest ``runtime.report``: its values, ``step`` and ``total_steps``). ``artifacts_uri``,
    ``checkpoint_uri``, ``timeline_uri``, ``try_number``, ``duration_s``, ``metrics`` and ``attempts`` are
    also pushed under their own keys, ``horovod_<name>``, by every try that got as far as storing its
    artifacts (failed and cancelled ones included).

    Artifacts go to ``<artifact_root>/<dag_id>/<run_id>/<task_id>[/map-<i>]/try-<n>/``. Each checkpoint rank 0
    completes is committed there while training runs, as a version (``versions/<seq>/``). A retry,
    or a clear of the task in the UI, starts a new ``try-<n>`` folder and (with ``resume="auto"``)
    hands the newest committed checkpoint of the earlier tries, a killed try's included, to the
    ranks as ``runtime.resume_dir()``.

    .. seealso:: ``docs/how-to.md``

    :param training_callable: the function every rank runs, or a ``"package.module:function"``
        reference string to an installed function.
    :param np: ``np > 0``: that many barrier tasks, one rank each; ``np < 0``: ``-np`` processes
        inside the Airflow task, with no Spark job. (templated)
    :param op_args: positional arguments for ``training_callable``. (templated)
    :param op_kwargs: keyword arguments for ``training_callable``. (templated)
    :param spark_conn_id: a ``spark`` or ``spark_connect`` connection; when ``spark_default`` is
        not defined, an embedded ``local[2]`` Spark runs inside the task. (templated)
    :param launcher: ``"mpirun"`` (default), ``"gloo"`` or ``"torch"`` (torch.distributed's own
        contract, as torchrun sets it: unmodified DDP, FSDP or ``accelerate`` code, no Horovod needed).
    :param driver_log_verbosity: ``"all"`` (default) or ``"log_callback_only"``.
    :param timeline: record a Horovod timeline on rank 0 and store it.
    :param artifact_root: where artifacts go (any ObjectStoragePath URL); defaults to
        ``[horovod] artifact_root``, itself defaulting to ``$AIRFLOW_HOME/horovod-artifacts``. (templated)
    :param spark_conf: Spark conf over the connection's extras. (templated)
    :param env: extra environment variables for every rank. (templated)
    :param resume: ``"auto"`` (default): on a retry, resume from the newest committed checkpoint
        of this task instance's earlier tries; ``"never"``; or the URI of a checkpoint (a try
        folder or a checkpoints folder). (templated)
    :param resume_on_clear: with ``resume="auto"``, whether the first try after a Clear resumes
        from the earlier tries' checkpoints. ``False`` (default): a Clear starts from scratch, as
        Airflow means it (3.4 empties the task's state store on Clear); retries after it resume
        from what the tries since the Clear committed. ``True``: a Clear resumes, as a retry does.
    :param start_timeout: seconds to wait for enough free barrier slots and for every barrier task
        to start (120 by default). On a cluster shared with other jobs, a task that finds the slots
        taken waits this long before it fails with ``InsufficientSlotsError``.
    :param stall_timeout: seconds a try may go without any rank making progress (a collective some
        rank never joins, a rank asleep or stopped) before it fails with ``StallError``, naming the
        stalled rank, where it is and every rank's stacks, instead of holding every slot until
        ``execution_timeout`` (600 by default; every launcher).
    :param max_artifact_bytes: the most rank 0's artifacts may hold (1 TiB by default); more fails
        the try with ``ArtifactError`` rather than fill the Airflow worker's disk.
    :param max_artifact_files: the most files rank 0's artifacts may hold (100 000 by default).
    :param keep_checkpoints: how many committed checkpoint versions each try keeps (2 by default);
        older ones are pruned only after a newer one is committed.
    :param dataset: training data every rank reads its shard of with ``runtime.dataset()``: a table
        name (``db.events``, ``parquet.`/data/events```), a Spark SQL query (``SELECT * FROM
        parquet.`/data/events` WHERE day <= '{{ ds }}'``), or a callable ``spark -> DataFrame``
        run in this task (not templated). It reaches the ranks through the barrier stage (needs ``np > 0``);
        a bad table, query or column fails with ``DatasetError`` before any rank starts. (templated)
    :param mlflow_conn_id: an Airflow connection to an MLflow tracking server (host: the tracking
        URI; login/password or the extra ``token``; the extra ``experiment``, else the DAG id). The
        driver, never a rank, logs one MLflow run per try: tags, params, every kept report, the
        newest checkpoint and the timeline; an unreachable server is a warning. (templated)
    :param max_restarts: how many times a try starts its barrier stage again, in the same Airflow try
        and SparkSession, after an executor, host or barrier task was lost (or a rank was killed by
        SIGKILL/SIGTERM from outside: the OOM killer, a preemption), resuming from the newest
        checkpoint version committed so far. An exception of the training function never restarts.
        2 by default: a restart costs seconds and at most one checkpoint interval, where an Airflow
        retry costs ``retry_delay``, a new SparkSession and new executors; two cover a second loss
        while the first is repaired (spot capacity is often lost in pairs), and a cluster that loses
        more is left to ``retries`` and ``HorovodRetryPolicy``. 0 turns restarts off.
    :param min_np: the fewest barrier tasks a restart runs on when fewer than ``np`` slots come back
        (``runtime.size()`` says how many); ``None`` (default): ``np``. (templated)
    :param last_call: seconds a restart that has ``min_np`` slots waits for the rest before it runs on
        what there is (30 by default; at once on a ``local[N]`` master, or when Spark decommissioned
        the lost executor's standalone worker).
    :param progress_interval: seconds between two ``Horovod progress:`` lines in the task log (from
        rank 0's ``runtime.report``); defaults to ``[horovod] progress_interval`` (30).
    :param retry_policy: Airflow's retry policy (AIP-105), an instance; by default a ``HorovodRetryPolicy``,
        which fails at once when no retry can help (the training function raised or crashed, a payload,
        dataset or environment error, too few slots on a ``local[N]`` master) and retries too few slots or a
        lost host, after its own delays unless the task sets ``retry_delay``; ``None``: Airflow's own rule
        (every failure retried ``retries`` times).
    """

    template_fields: Sequence[str] = (
        "np",
        "op_args",
        "op_kwargs",
        "spark_conn_id",
        "spark_conf",
        "env",
        "artifact_root",
        "resume",
        "dataset",
        "mlflow_conn_id",
        "min_np",
    )
    template_fields_renderers = {"op_args": "py", "op_kwargs": "py", "spark_conf": "json", "env": "json"}
    operator_extra_links = (SparkUILink(), HorovodTimelineLink(), MlflowRunLink())
    ui_color = "#e6f1f2"

    def __init__(
        self,
        *,
        training_callable: Callable[..., Any] | str,
        np: int | str = 2,
        op_args: Sequence[Any] | None = None,
        op_kwargs: dict[str, Any] | None = None,
        spark_conn_id: str = HorovodRunnerHook.default_conn_name,
        launcher: str = Launcher.MPIRUN.value,
        driver_log_verbosity: str = "all",
        timeline: bool = False,
        artifact_root: str | None = None,
        spark_conf: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        resume: str = RESUME_AUTO,
        resume_on_clear: bool = False,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        max_artifact_bytes: int = Limits.max_bytes,
        max_artifact_files: int = Limits.max_files,
        keep_checkpoints: int = DEFAULT_KEEP,
        dataset: str | Callable[[Any], Any] | None = None,
        progress_interval: float | None = None,
        mlflow_conn_id: str | None = None,
        max_restarts: int = DEFAULT_OPERATOR_RESTARTS,
        min_np: int | str | None = None,
        last_call: float = DEFAULT_LAST_CALL_S,
        **kwargs: Any,
    ) -> None:
        defaults = kwargs.get("default_args") or {}
        if "retry_policy" not in kwargs and "retry_policy" not in defaults:
            kwargs["retry_policy"] = retry.HorovodRetryPolicy()  # the task's own, even None, stays
        retry.check_policy(kwargs.get("retry_policy", defaults.get("retry_policy")))
        super().__init__(**kwargs)
        if ("retry_delay" in kwargs or "retry_delay" in defaults) and isinstance(self.retry_policy, retry.HorovodRetryPolicy):
            self.retry_policy = self.retry_policy.for_task(self.retry_delay)  # the policy's delays replace Airflow's default only
        # not templated: checked when the DAG is parsed, as the engine would check them
        check_options(launcher=launcher, driver_log_verbosity=driver_log_verbosity, start_timeout=start_timeout,
                      max_artifact_bytes=max_artifact_bytes, max_artifact_files=max_artifact_files, timeline=timeline,
                      stall_timeout=stall_timeout)
        check_restarts(max_restarts, None if _rendered_later(min_np) else min_np, np)
        check_last_call(last_call)
        check_when_parsed(training_callable, np=np, op_args=op_args, op_kwargs=op_kwargs, resume=resume)
        check_dataset(dataset, templated=True)
        check_kinds(training_callable, env=env)
        if not (mlflow_conn_id is None or isinstance(mlflow_conn_id, str)):
            raise TypeError("mlflow_conn_id must be the id of an Airflow connection (a str) or None; got %r." % (mlflow_conn_id,))
        if not isinstance(spark_conn_id, str):
            raise TypeError("spark_conn_id must be the id of an Airflow connection (a str); got %r." % (spark_conn_id,))
        if not (spark_conf is None or isinstance(spark_conf, dict) or _rendered_later(spark_conf)):
            raise TypeError("spark_conf must be a dict of Spark conf ({\"spark.executor.memory\": \"4g\"}); got %r (a %s)."
                            % (spark_conf, type(spark_conf).__name__))
        if isinstance(artifact_root, str) and not _rendered_later(artifact_root):
            check_root_syntax(artifact_root)
        if dataset is not None and isinstance(np, int) and np < 0:
            raise ValueError("dataset= needs np > 0: it reaches the ranks through the barrier stage; got np=%d" % np)
        self.training_callable = training_callable
        self.np = np
        self.op_args = op_args or []
        self.op_kwargs = op_kwargs or {}
        self.spark_conn_id = spark_conn_id
        self.launcher = launcher
        self.driver_log_verbosity = driver_log_verbosity
        self.timeline = timeline
        self.artifact_root = artifact_root
        self.spark_conf = spark_conf or {}
        self.env = env or {}
        self.resume = resume
        if not isinstance(resume_on_clear, bool):
            raise ValueError("resume_on_clear must be True or False; got %r" % (resume_on_clear,))
        self.resume_on_clear = resume_on_clear
        self.start_timeout = start_timeout
        self.stall_timeout = stall_timeout
        self.max_artifact_bytes = max_artifact_bytes
        self.max_artifact_files = max_artifact_files
        self.keep_checkpoints = check_keep(keep_checkpoints)
        # Airflow calls a callable in a templated field with the context: a DataFrame callable stays out
        self.dataset = None if callable(dataset) else dataset
        self.dataset_callable = dataset if callable(dataset) else None
        self.mlflow_conn_id = mlflow_conn_id
        self.max_restarts = max_restarts
        self.min_np = min_np
        self.last_call = float(last_call)
        self.progress_interval = None if progress_interval is None else check_progress_interval(progress_interval)

    @cached_property
    def hook(self) -> HorovodRunnerHook:
        return HorovodRunnerHook(self.spark_conn_id, spark_conf=self.spark_conf, app_name="%s.%s" % (self.dag_id, self.task_id))

    def execute(self, context: Context) -> dict[str, Any]:
        self._push_links(context)
        np = self._resolve()
        this_try = self._open_try(context)  # the try folder and the checkpoint it resumes from, before Spark starts
        with this_try.staging() as local:  # the resume copy goes with it, whatever ends the try (a Spark that never started too)
            self._push_spark_ui(context, np)
            on_checkpoint, on_report = this_try.sinks(self._mlflow_run(context, np))
            result, report, error = self._train(np, local, this_try.resume_from, on_checkpoint, on_report)
            xcom, status = this_try.record(result, report, error)
        this_try.record_final_checkpoint()
        self._push_results(context, xcom, report, status, this_try.source)
        if error is not None:
            raise error
        self._emit_asset_events(context, xcom)
        return xcom

    # -- the story's chapters --------------------------------------------------------------------
    def _resolve(self) -> int:
        """The rendered arguments checked as the engine would check them (``np``, ``resume``, the
        training function and its arguments); ``np`` as an int."""
        np = validate_np(self.np)
        validate_resume(self.resume)
        self.hook.check_job(self.training_callable, self.op_args, self.op_kwargs, launcher=self.launcher)
        return np

    def _open_try(self, context: Context) -> TryRecorder:
        """This try in the store (``recorder.TryRecorder``): its folder and its resume source."""
        return TryRecorder.open(context, self._try_settings(), hook=self.hook, log=self.log)

    def _try_settings(self) -> TrySettings:
        """The arguments (as rendered) that decide the try's life in the store."""
        return TrySettings(
            artifact_root=self.artifact_root, resume=self.resume, resume_on_clear=self.resume_on_clear,
            retries=self.retries, keep_checkpoints=self.keep_checkpoints, launcher=self.launcher,
            progress_interval=self.progress_interval, retry_policy=self.retry_policy,
        )

    def _mlflow_run(self, context: Context, np: int) -> Any:
        """With ``mlflow_conn_id``: this try's MLflow run, its URL pushed for the "MLflow run" link."""
        if not self.mlflow_conn_id:
            return None
        from airflow_provider_horovod.hooks.mlflow import MlflowTrackingHook

        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        tags = {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id, "try": str(ti.try_number),
                "map_index": str(map_index if isinstance(map_index, int) else -1)}
        params = {"np": np, "launcher": Launcher(self.launcher).value, **dict(self.op_kwargs)}
        run = MlflowTrackingHook(self.mlflow_conn_id).start_run(experiment=ti.dag_id, tags=tags, params=params)
        if run is not None:
            MlflowRunLink().persist(context, run.url)
        return run

    def _push_links(self, context: Context) -> None:
        """Each link's key exists from the start (a task that fails early logs no `XCom not found`);
        the Horovod view's link works while the task runs."""
        HorovodTimelineLink().persist(context, HorovodTimelineLink.view_url(context["ti"]))
        SparkUILink().persist(context, None)
        MlflowRunLink().persist(context, None)

    def _push_spark_ui(self, context: Context, np: int) -> None:
        if np > 0:  # builds the SparkSession: its application is known before the job starts
            SparkUILink().persist(context, self.hook.history_server_url(self.hook.get_conn()))

    def _train(self, np: int, local_dir: str, resume_from: str | None,
               on_checkpoint: Callable[[Any, Any], None],
               on_report: Callable[[Any], None]) -> tuple[Any, RunReport, BaseException | None]:
        from airflow_provider_horovod import ArtifactError

        try:
            result, report = self.hook.run(
                self.training_callable, np=np, op_args=list(self.op_args), op_kwargs=dict(self.op_kwargs),
                launcher=self.launcher, driver_log_verbosity=self.driver_log_verbosity, env=dict(self.env),
                timeline=self.timeline, artifact_dir=local_dir, resume_from=resume_from,
                start_timeout=self.start_timeout, stall_timeout=self.stall_timeout, max_artifact_bytes=self.max_artifact_bytes,
                max_artifact_files=self.max_artifact_files, keep_checkpoints=self.keep_checkpoints,
                on_checkpoint=on_checkpoint, dataset=self.dataset_callable or self.dataset, on_report=on_report,
                max_restarts=self.max_restarts, min_np=validate_min_np(self.min_np, np),
                last_call=self.last_call,
            )
            return result, report, None
        except (HorovodRunError, ArtifactError) as err:  # returned: the try stores what the run left, execute raises it
            return None, self.hook.last_run, err
        except BaseException as err:  # execution_timeout and the like: stored as well where the engine cancelled the run
            if self.hook.last_run is None or self.hook.last_run.status != RunStatus.CANCELLED:
                raise  # no run was started, or the engine did not end it as cancelled: nothing to store
            return None, self.hook.last_run, err

    def _push_results(self, context: Context, xcom: dict[str, Any], report: RunReport, status: store.TryStatus,
                      resumed_from: store.Checkpoint | None) -> None:
        """The try's metadata, each under its own XCom key, and its summary in the task log."""
        self._push_metadata(context, xcom)
        self._log_summary(xcom, report, status, resumed_from)

    def _push_metadata(self, context: Context, xcom: dict[str, Any]) -> None:
        ti = context["ti"]
        for name in METADATA:
            ti.xcom_push(key=METADATA_XCOM_PREFIX + name, value=xcom[name])

    def _log_summary(self, xcom: dict[str, Any], report: RunReport, status: store.TryStatus, resumed_from: Any) -> None:
        duration = xcom["duration_s"]
        self.log.info(
            "Horovod summary: %s; %s with %s in %s s; resumed from %s; artifacts in %s (checkpoint: %s, timeline: %s)",
            "succeeded" if status == store.TryStatus.SUCCESS else status.value,
            _ranks_text(xcom["np"]), xcom["launcher"],
            "%.1f" % duration if isinstance(duration, (int, float)) else "?",
            resumed_from.describe() if resumed_from is not None else "nothing (a fresh start)",
            xcom["artifacts_uri"], xcom["checkpoint_uri"] or NO_CHECKPOINT, xcom["timeline_uri"] or "none",
        )
        if len(report.attempts) > 1:
            self.log.info("Horovod attempts in this try (restarts after lost infrastructure): %s",
                          "; ".join(a.describe() for a in report.attempts))
        versions = report.checkpoints
        if versions:
            self.log.info("Checkpoint versions committed during this try: %s",
                          ", ".join("%d (step %s)" % (v["seq"], v["step"]) for v in versions))

        if not xcom["checkpoint_uri"] and status == store.TryStatus.SUCCESS:
            self.log.warning("This try kept no checkpoint: rank 0 left runtime.checkpoint_dir() empty, so a retry starts "
                             "from scratch and checkpoint_uri is None for later tasks. Save under "
                             "runtime.checkpoint_dir() (files saved anywhere else do not come back).")

    def _emit_asset_events(self, context: Context, xcom: dict[str, Any]) -> None:
        extra = {k: xcom[k] for k in ("checkpoint_uri", "timeline_uri", "try_number", "artifacts_uri", "metrics")}
        if is_json(xcom["result"]) and len(json.dumps(xcom["result"])) <= SMALL_RESULT_CHARS:
            extra["result"] = xcom["result"]
        for outlet in self.outlets:
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra.update(extra)

    def on_kill(self) -> None:
        """SIGTERM, execution_timeout or "mark failed": interrupt the Spark job and kill every rank."""
        self.log.info("Cancelling the Horovod job")
        self.hook.cancel()


def validate_np(np: Any) -> int:
    """``np`` after templating: a non-zero int (a string of digits from a template counts)."""
    value = np
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value == 0:
        raise ValueError(
            "np must be a non-zero int after templating (np > 0: barrier tasks, np < 0: local processes); "
            "got %r. Fix the np argument or the template that renders it." % (np,)
        )
    return value


def validate_min_np(min_np: Any, np: int) -> int | None:
    """``min_np`` as rendered (a template gives a str): an int, or ``None``; a clear error otherwise."""
    if isinstance(min_np, str):
        try:
            min_np = int(min_np.strip())
        except ValueError:
            raise ValueError("min_np must render to an int; got %r" % (min_np,)) from None
    check_restarts(0, min_np, np)
    return min_np


def validate_resume(resume: Any) -> None:
    """``resume`` after templating: ``"auto"``, ``"never"`` (or empty), or where a checkpoint is."""
    if resume in (None, "", RESUME_AUTO, RESUME_NEVER):
        return
    if not isinstance(resume, str) or not (re.match(r"^[a-zA-Z][\w+.-]*://", resume) or resume.startswith("/")):
        raise ValueError(
            "resume must be 'auto', 'never', or the URI of a checkpoint (a try folder or its checkpoints/: "
            "s3://bucket/..., file:///..., or an absolute path); got %r." % (resume,)
        )


def check_when_parsed(training_callable: Any, *, np: Any, op_args: Any, op_kwargs: Any, resume: Any) -> None:
    """What can be checked when the DAG is parsed: the values that are not rendered later (a Jinja
    template, an XComArg) get the check ``execute`` gives them after templating."""
    if not _rendered_later(np):
        validate_np(np)
    if not _rendered_later(resume):
        validate_resume(resume)
    check_kinds(training_callable, op_args=op_args, op_kwargs=op_kwargs)
    args, kwargs = op_args or [], op_kwargs or {}
    if callable(training_callable) and isinstance(args, (list, tuple)) and isinstance(kwargs, dict):
        check_arguments(training_callable, tuple(args), kwargs)  # names and number only: values may be templates


def check_kinds(training_callable: Any, *, op_args: Any = None, op_kwargs: Any = None, env: Any = None) -> None:
    """Values of a kind that would be accepted when the DAG is parsed and fail (or mean something else) later:
    a ``TypeError`` naming the fix. A string ``op_args`` would become one argument per character."""
    if not (callable(training_callable) or isinstance(training_callable, str)):
        raise TypeError("training_callable must be a function or a 'package.module:function' string; got %r (a %s)."
                        % (training_callable, type(training_callable).__name__))
    if not (op_args is None or isinstance(op_args, (list, tuple)) or _rendered_later(op_args)):
        raise TypeError("op_args must be a list of positional arguments; got %r (a %s). For one argument: op_args=[value]."
                        % (op_args, type(op_args).__name__))
    if not (op_kwargs is None or isinstance(op_kwargs, dict) or _rendered_later(op_kwargs)):
        raise TypeError("op_kwargs must be a dict of keyword arguments; got %r (a %s)." % (op_kwargs, type(op_kwargs).__name__))
    if env is None or _rendered_later(env):
        return
    if not isinstance(env, dict):
        raise TypeError("env must be a dict of environment variables for every rank; got %r (a %s)." % (env, type(env).__name__))
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not (isinstance(v, str) or _rendered_later(v))}
    if bad:
        raise TypeError("env must map names to strings (environment values are text): fix %s, e.g. {\"OMP_NUM_THREADS\": "
                        "\"4\"}." % ", ".join("%r: %r" % item for item in bad.items()))


def _rendered_later(value: Any) -> bool:
    return isinstance(value, ResolveMixin) or (isinstance(value, str) and ("{{" in value or "{%" in value))


def _ranks_text(np: int) -> str:
    """``np`` as the summary says it: ``2 ranks``, or ``2 local processes`` for ``np=-2``."""
    return "%d local processes" % -np if np < 0 else "%d ranks" % np
