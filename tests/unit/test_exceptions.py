"""The driver's errors for a failed rank: of the provider type the rank raised, and HorovodRunError."""

from __future__ import annotations

import pytest

from airflow_provider_horovod.exceptions import (
    ArtifactError,
    HorovodRunError,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
    provider_class_name,
    rank_error,
)


@pytest.mark.parametrize("cls", [Keras3NotSupportedError, PayloadError, ArtifactError])
def test_a_provider_exception_raised_in_a_rank_is_that_type_on_the_driver(cls):
    err = rank_error(cls.__name__, "Rank 1 failed: boom", rank=1, host="hvdhost0", remote_traceback="Traceback ...")
    assert isinstance(err, cls) and isinstance(err, HorovodRunError)
    assert type(err).__name__ == cls.__name__
    assert (err.rank, err.host, err.remote_traceback) == (1, "hvdhost0", "Traceback ...")
    assert str(err).startswith("Rank 1 failed: boom")
    with pytest.raises(cls):  # the documented except clause
        raise err


def test_a_users_own_exception_is_a_plain_horovod_run_error():
    err = rank_error(None, "Rank 0 failed: ValueError: boom", rank=0)
    assert type(err) is HorovodRunError
    assert type(rank_error("NoSuchError", "x")) is HorovodRunError
    assert type(rank_error("annotations", "x")) is HorovodRunError  # a module global that is no exception class


def test_a_horovod_run_error_subclass_raised_in_a_rank_keeps_its_type():
    assert type(rank_error("RunCancelledError", "x", rank=0)) is RunCancelledError


def test_the_rank_names_the_nearest_provider_class_of_its_exception():
    class MyPayloadProblem(PayloadError):
        pass

    assert provider_class_name(MyPayloadProblem("x")) == "PayloadError"
    assert provider_class_name(Keras3NotSupportedError("x")) == "Keras3NotSupportedError"
    assert provider_class_name(ValueError("x")) is None
