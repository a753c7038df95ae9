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
