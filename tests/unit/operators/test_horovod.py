"""HorovodRunnerOperator and @task.horovod: arguments, templating and validation before anything starts."""

from __future__ import annotations

import tempfile

import pytest

from airflow.sdk import DAG, task

from airflow_provider_horovod.decorators.horovod import horovod_task
from airflow_provider_horovod.exceptions import DatasetError, PayloadError
from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook
from airflow_provider_horovod.links import HorovodTimelineLink, MlflowRunLink, SparkUILink
from airflow_provider_horovod.operators.horovod import HorovodRunnerOperator, _ranks_text, validate_min_np, validate_np


def train(lr: float, epochs: int = 1):
    return {"lr": lr, "epochs": epochs}


def test_template_fields_are_the_documented_ones():
    assert set(HorovodRunnerOperator.template_fields) >= {
        "np", "op_args", "op_kwargs", "spark_conn_id", "spark_conf", "env", "artifact_root",
    }


def test_templated_fields_render_from_the_context():
    with DAG("d", schedule=None):
        op = HorovodRunnerOperator(
            task_id="t", training_callable=train, np="{{ params.ranks }}", op_kwargs={"lr": "{{ params.lr }}"},
            spark_conn_id="{{ params.conn }}", spark_conf={"spark.executor.memory": "{{ params.mem }}"},
            env={"SEED": "{{ params.seed }}"}, artifact_root="/tmp/{{ params.conn }}",
        )
    op.render_template_fields({"params": {"ranks": 3, "lr": 0.1, "conn": "spark_gpu", "mem": "4g", "seed": 7}})
    assert validate_np(op.np) == 3
    assert op.op_kwargs == {"lr": "0.1"}
    assert (op.spark_conn_id, op.spark_conf, op.env, op.artifact_root) == (
        "spark_gpu", {"spark.executor.memory": "4g"}, {"SEED": "7"}, "/tmp/spark_gpu",
    )
    assert isinstance(op.hook, HorovodRunnerHook) and op.hook.spark_conn_id == "spark_gpu"


@pytest.mark.parametrize(("option", "value", "message"), [
    ("launcher", "ssh", "launcher must be one of mpirun, gloo"),
    ("driver_log_verbosity", "some", "driver_log_verbosity must be one of"),
    ("start_timeout", 0, "start_timeout must be a positive number of seconds"),
    ("start_timeout", "120", "start_timeout must be a positive number of seconds"),
    ("max_artifact_bytes", 0, "max_artifact_bytes must be a positive int"),
    ("max_artifact_files", 2.5, "max_artifact_files must be a positive int"),
    ("max_restarts", -1, "max_restarts must be an int >= 0"),
    ("min_np", 3, "min_np=3 is more than np=2"),
    ("last_call", -1, "last_call must be a number of seconds >= 0"),
])
def test_engine_options_are_checked_when_the_dag_is_parsed(option, value, message):
    with pytest.raises(ValueError, match=message):
        HorovodRunnerOperator(task_id="t", training_callable=train, **{option: value})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"training_callable": 42}, "training_callable must be a function or a 'package.module:function' string"),
    ({"op_args": "lr"}, "op_args must be a list of positional arguments; got 'lr' (a str). For one argument: op_args=[value]"),
    ({"op_kwargs": [("lr", 0.1)]}, "op_kwargs must be a dict of keyword arguments"),
    ({"env": {"OMP_NUM_THREADS": 4}}, "env must map names to strings (environment values are text): fix 'OMP_NUM_THREADS': 4"),
    ({"env": "OMP_NUM_THREADS=4"}, "env must be a dict of environment variables for every rank"),
    ({"mlflow_conn_id": {"host": "x"}}, "mlflow_conn_id must be the id of an Airflow connection"),
    ({"spark_conn_id": None}, "spark_conn_id must be the id of an Airflow connection (a str); got None"),
    ({"spark_conf": [("spark.executor.memory", "4g")]}, "spark_conf must be a dict of Spark conf"),
])
def test_a_value_of_the_wrong_kind_is_refused_when_the_dag_is_parsed_not_when_it_runs(kwargs, message):
    """Each was accepted before: a str op_args became one argument per character, a non-str env value failed
    only after the SparkSession had started."""
    with pytest.raises(TypeError) as info:
        HorovodRunnerOperator(task_id="t", **{"training_callable": train, "op_args": [0.1], **kwargs})
    assert message in str(info.value)


def test_templated_values_are_left_to_be_checked_after_rendering():
    HorovodRunnerOperator(task_id="t", training_callable=train, op_args="{{ params.args }}",
                          env={"RUN": "{{ run_id }}", "DAY": "{{ ds }}"})


class RecordingTaskInstance:
    """What ``execute`` needs of a task instance before anything starts: its keys and ``xcom_push``."""

    dag_id, run_id, task_id, map_index, try_number = "d", "manual__1", "t", -1, 1

    def __init__(self) -> None:
        self.pushed: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.pushed[key] = value


@pytest.mark.parametrize("np", ["two", "2.5", "", None, 0, "0", True, 1.5, [2]])
def test_untemplated_np_that_is_not_a_non_zero_int_fails_when_the_dag_is_parsed(np):
    with pytest.raises(ValueError, match=r"np must be a non-zero int after templating .*Fix the np argument"):
        HorovodRunnerOperator(task_id="t", training_callable=train, np=np, op_kwargs={"lr": 0.1})


@pytest.mark.parametrize("rendered", ["two", "0", ""])
def test_templated_np_that_renders_badly_fails_execute_after_pushing_the_link_keys(rendered):
    op = HorovodRunnerOperator(task_id="t", training_callable=train, np="{{ params.ranks }}", op_kwargs={"lr": 0.1})
    op.render_template_fields({"params": {"ranks": rendered}})
    ti = RecordingTaskInstance()
    with pytest.raises(ValueError, match=r"np must be a non-zero int after templating"):
        op.execute({"ti": ti})  # before any connection or Spark
    # every extra link's key exists, so the end of the failed task logs no "XCom not found"
    assert set(ti.pushed) == {SparkUILink.xcom_key, HorovodTimelineLink.xcom_key, MlflowRunLink.xcom_key}


def test_op_kwargs_key_the_function_does_not_take_fails_when_the_dag_is_parsed():
    with pytest.raises(PayloadError, match=r"do not fit the training function train\(lr: float, epochs: int = 1\).*"
                                            r"unexpected keyword argument 'epoch'.*Fix op_args/op_kwargs"):
        HorovodRunnerOperator(task_id="t", training_callable=train, op_kwargs={"lr": 0.1, "epoch": 3})


def test_missing_argument_fails_when_the_dag_is_parsed_even_with_templated_values():
    with pytest.raises(PayloadError, match="missing a required argument: 'lr'"):
        HorovodRunnerOperator(task_id="t", training_callable=train, op_kwargs={"epochs": "{{ params.e }}"})
    HorovodRunnerOperator(task_id="t", training_callable=train, op_args=["{{ params.lr }}"])  # fits: no error


def test_task_horovod_call_that_does_not_fit_the_function_fails_when_the_dag_is_parsed():
    with DAG("d", schedule=None), pytest.raises(TypeError, match="epoch"):
        task.horovod(np=2)(train)(lr=0.1, epoch=3)


def test_op_kwargs_of_a_reference_string_are_checked_before_anything_starts():
    with pytest.raises(PayloadError, match="unexpected keyword argument 'epochs'"):
        HorovodRunnerHook.check_job("airflow_provider_horovod.runtime:size", (), {"epochs": 3})


def test_timeline_that_is_not_a_bool_fails_when_the_dag_is_parsed():
    with pytest.raises(ValueError, match="timeline must be True or False; got 'yes'"):
        HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], timeline="yes")


@pytest.mark.parametrize("resume", ["sometimes", "checkpoints/epoch-3", 3])
def test_resume_that_is_neither_a_keyword_nor_a_uri_fails_when_the_dag_is_parsed(resume):
    with pytest.raises(ValueError, match="resume must be 'auto', 'never', or the URI of a checkpoint"):
        HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], resume=resume)


@pytest.mark.parametrize("resume", ["auto", "never", "", None, "s3://bucket/model/try-1", "file:///ckpt", "/data/ckpt"])
def test_resume_keywords_and_uris_are_accepted(resume):
    HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], resume=resume)


def test_templated_resume_is_checked_after_templating():
    op = HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], resume="{{ params.resume }}")
    op.render_template_fields({"params": {"resume": "sometimes"}})
    with pytest.raises(ValueError, match="got 'sometimes'"):
        op.execute({"ti": RecordingTaskInstance()})


@pytest.mark.parametrize(("np", "value"), [(2, 2), ("2", 2), (" 4 ", 4), (-2, -2), ("-1", -1)])
def test_np_rendered_as_digits_is_accepted(np, value):
    assert validate_np(np) == value


def test_reference_string_that_does_not_import_is_a_payload_error():
    with pytest.raises(PayloadError, match="Cannot import module 'no_such_pkg_for_hvd.train'.*Install the package"):
        HorovodRunnerHook.check_job("no_such_pkg_for_hvd.train:main")


def test_operator_offers_the_spark_ui_timeline_and_mlflow_links():
    names = {link.name for link in HorovodRunnerOperator.operator_extra_links}
    assert names == {"Spark UI", "Horovod timeline", "MLflow run"}
    assert len({SparkUILink().xcom_key, HorovodTimelineLink().xcom_key, MlflowRunLink().xcom_key}) == 3


def test_task_horovod_is_registered_and_builds_the_operator():
    assert task.horovod is horovod_task

    with DAG("d", schedule=None) as dag:

        @task.horovod(np=2, timeline=True, launcher="gloo")
        def fit(lr: float, epochs: int = 1):
            return lr * epochs

        fit(0.5, epochs=3)

    (op,) = dag.tasks
    assert isinstance(op, HorovodRunnerOperator)
    assert (op.np, op.launcher, op.timeline, op.resume) == (2, "gloo", True, "auto")
    assert op.training_callable.__name__ == "fit"
    assert (list(op.op_args), op.op_kwargs) == ([0.5], {"epochs": 3})
    assert "np" in op.template_fields and "op_kwargs" in op.template_fields


def test_restarts_are_on_by_default_in_the_operator_and_min_np_is_templated_and_checked_after_rendering():
    with DAG("d", schedule=None) as dag:

        @task.horovod(np=4, min_np="{{ params.fewest }}")
        def fit():
            return 1

        fit()

    (op,) = dag.tasks
    assert (op.max_restarts, op.min_np) == (2, "{{ params.fewest }}") and "min_np" in op.template_fields
    op.render_template_fields({"params": {"fewest": 2}})
    assert validate_min_np(op.min_np, 4) == 2
    with pytest.raises(ValueError, match="min_np must render to an int; got 'two'"):
        validate_min_np("two", 4)
    assert op.last_call == 30.0  # a restart with min_np slots waits this long for the rest


def test_task_horovod_takes_a_last_call_for_its_restarts():
    with DAG("d", schedule=None) as dag:

        @task.horovod(np=4, min_np=2, last_call=5)
        def fit():
            return 1

        fit()

    (op,) = dag.tasks
    assert op.last_call == 5.0


def test_dataset_query_is_templated_and_reaches_task_horovod():
    with DAG("d", schedule=None) as dag:

        @task.horovod(np=2, dataset="SELECT * FROM parquet.`/data/events` WHERE day <= '{{ ds }}'")
        def fit():
            return 1

        fit()

    (op,) = dag.tasks
    assert "dataset" in op.template_fields
    op.render_template_fields({"ds": "2026-12-04"})
    assert op.dataset == "SELECT * FROM parquet.`/data/events` WHERE day <= '2026-12-04'"


def test_dataset_callable_is_kept_as_is_through_templating():
    def events(spark):
        return spark.table("events")

    with DAG("d", schedule=None):
        op = HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], dataset=events)
    op.render_template_fields({"ds": "2026-12-04"})  # Airflow would call a callable template field
    assert op.dataset_callable is events and op.dataset is None


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"dataset": 3}, DatasetError, "dataset must be a table name, a Spark SQL query, a callable"),
    ({"dataset": " "}, DatasetError, "dataset is an empty string"),
    ({"dataset": "events", "np": -2}, ValueError, "dataset= needs np > 0"),
])
def test_bad_dataset_arguments_fail_when_the_dag_is_parsed(kwargs, error, message):
    with pytest.raises(error, match=message):
        HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], **kwargs)


def _report(status, error=None):
    from airflow_provider_horovod.runner.events import RunReport
    from airflow_provider_horovod.runner.options import Launcher

    return RunReport(run_id="r", np=2, launcher=Launcher.GLOO, status=status, error=error)


def test_a_try_whose_run_succeeded_but_whose_artifacts_did_not_come_back_is_failed():
    from airflow_provider_horovod.exceptions import ArtifactError
    from airflow_provider_horovod.recorder import try_status
    from airflow_provider_horovod.runner.events import RunStatus

    assert try_status(_report(RunStatus.SUCCESS), None) == "success"
    assert try_status(_report(RunStatus.SUCCESS), ArtifactError("lost")) == "failed"
    assert try_status(_report(RunStatus.CANCELLED), KeyboardInterrupt()) == "cancelled"


def test_the_marker_keeps_the_engines_failure_report_else_one_made_from_the_exception():
    from airflow_provider_horovod.exceptions import HorovodRunError
    from airflow_provider_horovod.recorder import failure_record
    from airflow_provider_horovod.runner.events import Failure, RunStatus

    engine = Failure("Rank 1 on host hvdhost1 raised ValueError: boom", rank=1).to_json()
    assert failure_record(HorovodRunError("x"), _report(RunStatus.FAILED, engine)) == engine
    made = failure_record(HorovodRunError("mpirun exited with code 1\nmore"), _report(RunStatus.FAILED))
    assert made["message"] == "mpirun exited with code 1"
    assert made["exception"] == "HorovodRunError: mpirun exited with code 1"
    assert set(made) == set(engine)  # one record: the fields of events.Failure


@pytest.mark.parametrize(("np", "said"), [(2, "2 ranks"), (-2, "2 local processes")])
def test_the_summary_counts_local_processes_as_processes_not_negative_ranks(np, said):
    assert _ranks_text(np) == said


@pytest.mark.parametrize(("checkpoint_uri", "warned"), [(None, True), ("file:///a/try-1/checkpoints", False)])
def test_the_summary_says_when_rank_0_left_checkpoint_dir_empty(caplog, capfd, checkpoint_uri, warned):
    import logging

    from airflow_provider_horovod import store
    from airflow_provider_horovod.runner.events import RunStatus

    op = HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1])
    xcom = {"duration_s": 1.0, "np": 2, "launcher": "mpirun", "artifacts_uri": "file:///a/try-1",
            "checkpoint_uri": checkpoint_uri, "timeline_uri": None}
    with caplog.at_level(logging.INFO):
        op._log_summary(xcom, _report(RunStatus.SUCCESS), store.TryStatus.SUCCESS, None)
    text = caplog.text + "".join(capfd.readouterr())  # the task's logger goes through Airflow's structlog
    assert "Horovod summary: succeeded" in text
    assert ("checkpoint: none: rank 0 left runtime.checkpoint_dir() empty" in text) is warned
    assert ("This try kept no checkpoint: rank 0 left runtime.checkpoint_dir() empty" in text) is warned


def test_a_try_whose_spark_never_starts_leaves_no_copy_of_the_checkpoint_it_would_resume_from(tmp_path, monkeypatch):
    checkpoint = tmp_path / "root" / "ckpt"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"weights")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the resume copy is made
    op = HorovodRunnerOperator(task_id="t", training_callable=train, op_args=[0.1], np=2,
                               artifact_root=str(tmp_path / "root"), resume=str(checkpoint),
                               spark_conn_id="no_such_spark_conn_for_hvd")
    with pytest.raises(Exception, match="no_such_spark_conn_for_hvd"):
        op.execute({"ti": RecordingTaskInstance(), "task_state_store": None})
    assert list(temp.glob("hvdresume-*")) == []  # on main's code: the copy stayed
