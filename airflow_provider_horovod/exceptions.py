"""Exceptions raised by the engine and the Airflow layer; each message says what to do."""

from __future__ import annotations


class HorovodRunError(RuntimeError):
    """A Horovod job failed, was cancelled, or could not start.

    :param message: what happened and what to do about it.
    :param rank: the rank that failed first, when known.
    :param host: the host identity of that rank, when known.
    :param remote_traceback: the failing rank's traceback text, when known.
    :param log_tail: the last lines each rank printed, by rank.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        host: str | None = None,
        remote_traceback: str | None = None,
        log_tail: dict[int, list[str]] | None = None,
    ) -> None:
        self.rank = rank
        self.host = host
        self.remote_traceback = remote_traceback
        self.log_tail = log_tail or {}
        text = message
        if remote_traceback:
            text += "\n\nRemote traceback (rank %s on %s):\n%s" % (rank, host, remote_traceback.rstrip())
        super().__init__(text)


class RunCancelledError(HorovodRunError):
    """The run was cancelled (``cancel()``, KeyboardInterrupt or SIGTERM)."""


class InsufficientSlotsError(HorovodRunError):
    """The cluster has fewer barrier slots than the ranks asked for."""


class PayloadError(ValueError):
    """The training callable or its arguments cannot be shipped to the ranks."""


class Keras3NotSupportedError(TypeError):
    """A training function gave Keras 3 objects to Horovod's Keras API, which trains them wrong.

    Raised inside the rank (``runner.keras_guard``); the run fails with it as the rank's error.
    """


class ArtifactError(RuntimeError):
    """Artifacts could not be written or read; the message names the path.

    :param result: rank 0's return value, when the run itself succeeded before the problem.
    """

    def __init__(self, message: str, *, result: object = None) -> None:
        self.result = result
        if result is not None:
            message += " Rank 0's result was: %r" % (result,)
        super().__init__(message)


class DatasetError(ValueError):
    """The ``dataset=`` of a run cannot be trained on (no such table, a query that does not parse,
    too few rows, a column type no adapter takes), or ``runtime.dataset()`` was called in a run
    without one. Raised before any rank starts; the message names the fix."""
