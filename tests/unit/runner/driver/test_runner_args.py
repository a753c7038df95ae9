from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner


@pytest.mark.parametrize("np", [0, 1.5, "2", True, None])
def test_np_must_be_a_non_zero_int(np):
    with pytest.raises(ValueError, match="np must be"):
        HorovodRunner(np)


def test_unknown_launcher_is_refused():
    with pytest.raises(ValueError, match="launcher must be one of mpirun, gloo"):
        HorovodRunner(2, launcher="ssh")


def test_unknown_verbosity_is_refused():
    with pytest.raises(ValueError, match="driver_log_verbosity"):
        HorovodRunner(2, driver_log_verbosity="some")


def test_env_values_must_be_strings():
    with pytest.raises(ValueError, match="env must map str to str"):
        HorovodRunner(2, env={"X": 1})


@pytest.mark.parametrize("start_timeout", [0, -1, float("inf"), "120", None, True])
def test_start_timeout_must_be_a_positive_number(start_timeout):
    with pytest.raises(ValueError, match="start_timeout must be a positive number of seconds"):
        HorovodRunner(2, start_timeout=start_timeout)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"on_report": "print"}, TypeError, "on_report must be a function (or None); got 'print' (a str)"),
    ({"on_checkpoint": 3}, TypeError, "on_checkpoint must be a function (or None)"),
    ({"spark": "local[2]"}, TypeError, "spark must be a SparkSession (or None for the active one); got a str"),
    ({"artifact_dir": "s3://bucket/run-1"}, ValueError, "the engine's artifact_dir is a local folder"),
    ({"artifact_dir": "s3:/bucket/run-1"}, ValueError, "the engine's artifact_dir is a local folder"),
])
def test_engine_values_of_the_wrong_kind_are_refused_when_the_runner_is_made(kwargs, error, message):
    """Each was accepted before and failed only when a report or a checkpoint came, when the job started, or
    never (a folder named ``s3:``)."""
    with pytest.raises(error) as info:
        HorovodRunner(2, **kwargs)
    assert message in str(info.value)


def test_a_spark_context_is_refused_naming_the_session_to_pass_instead():
    class SparkContextLike:  # what matters: no createDataFrame, as a SparkContext
        def range(self, n):
            return n

    with pytest.raises(TypeError, match=r"For a SparkContext sc, pass SparkSession\(sc\)"):
        HorovodRunner(2, spark=SparkContextLike())
