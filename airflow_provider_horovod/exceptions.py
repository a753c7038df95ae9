"""Exceptions raised by the engine and the Airflow layer; each message says what to do."""

from __future__ import annotations

import functools

from airflow_provider_horovod.runner.text import one_line, quoted_text


class HorovodRunError(RuntimeError):
    """A Horovod job failed, was cancelled, or could not start.

    :param message: what happened and what to do about it.
    :param rank: the rank that failed first, when known.
    :param host: the host identity of that rank, when known.
    :param remote_traceback: the failing rank's traceback text, when known.
    :param log_tail: the last lines each rank printed, by rank.

    ``failure`` is the engine's failure report (``runner.events.Failure`` as JSON) when the run got
    as far as making one; ``HorovodRetryPolicy`` reads it.
    """

    failure: dict | None = None

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
        if remote_traceback:  # the rank's own text: every line escaped and indented (``runner.text``)
            text += "\n\nRemote traceback (rank %s on %s):\n%s" % (rank, one_line(host), quoted_text(remote_traceback))
        super().__init__(text)


class RunCancelledError(HorovodRunError):
    """The run was cancelled (``cancel()``, KeyboardInterrupt or SIGTERM)."""


class InsufficientSlotsError(HorovodRunError):
    """The cluster has fewer barrier slots than the ranks asked for."""


class FixedSlotsError(InsufficientSlotsError):
    """The cluster has fewer barrier slots than the ranks asked for, and its slots cannot grow (a
    ``local[N]`` master, where no executor joins): no wait and no retry fixes it."""


class TrainingStackError(HorovodRunError):
    """The driver's Python cannot run a job: Horovod is missing, or built without a framework, MPI
    or Gloo, or its framework is not installed. Raised before Spark starts; the message names the
    missing piece and the command that installs it."""


class ExecutorMismatchError(HorovodRunError):
    """An executor's environment differs from the driver's (this provider's version, the Horovod
    build). Raised before any rank starts; the message names the host and what differs."""


class ClusterSettingsError(HorovodRunError):
    """The Spark session's settings cannot run a barrier stage (``spark.dynamicAllocation.enabled``,
    ...). Raised before the job starts; the message names the setting and its fix."""


class StallError(HorovodRunError):
    """No rank made progress for ``stall_timeout`` (the driver's stall rule). The first line names the
    stalled ranks; the message holds every rank's Python stacks.

    ``unresponsive``: a stalled rank did not answer (stopped, stuck in native code, gone): the
    infrastructure, which an in-try restart and ``HorovodRetryPolicy`` retry. Otherwise a rank was
    stuck in the user's code: a bug, which neither restarts nor retries.
    """

    @property
    def unresponsive(self) -> bool:
        return (self.failure or {}).get("stall") == "unresponsive"


class PayloadError(ValueError):
    """The training callable or its arguments cannot be shipped to the ranks."""


class Keras3NotSupportedError(TypeError):
    """A training function gave Keras 3 objects to Horovod's Keras API, which trains them wrong.

    Raised inside the rank (``runner.rank.keras_guard``); the run fails with it as the rank's error.
    """


class WrongLauncherError(RuntimeError):
    """Training code initialised Horovod in a rank that ``launcher="torch"`` started: Horovod would
    train every rank as a world of one (nothing averaged). Raised at ``hvd.init()``."""


class ArtifactError(RuntimeError):
    """Artifacts could not be written or read; the message names the path.

    :param result: rank 0's return value, when the run itself succeeded before the problem.
    """

    def __init__(self, message: str, *, result: object = None) -> None:
        self.result = result
        if result is not None:
            message += " Rank 0's result was: %r" % (result,)
        super().__init__(message)


class ArtifactSettingsError(ArtifactError):
    """The artifact root or an id the store names folders by cannot be used as given (a malformed URL, a
    file system that is not installed, an undefined connection, a ``run_id`` of ``..``): the same value
    fails every try, so the retry policy fails it at once. Raised before Spark starts."""


def provider_class_name(err: BaseException) -> str | None:
    """The name of the nearest class of this module in ``err``'s ancestry, or ``None`` (a user's
    own exception). A rank sends it with its failure, so the driver can raise the same type."""
    return next((c.__name__ for c in type(err).__mro__ if c.__module__ == __name__), None)


def rank_error(class_name: str | None, message: str, **details: object) -> HorovodRunError:
    """The driver's error for a failed rank: a ``HorovodRunError`` (``rank``, ``host``,
    ``remote_traceback``, ``log_tail`` in ``details``) that is also of the provider exception the
    rank raised, so ``except Keras3NotSupportedError`` works on the driver as documented. A user's
    own exception gives a plain ``HorovodRunError``."""
    cls = globals().get(class_name or "")
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return HorovodRunError(message, **details)
    if issubclass(cls, HorovodRunError):
        return cls(message, **details)
    return _raised_in_a_rank(cls)(message, **details)


@functools.cache
def _raised_in_a_rank(cls: type[Exception]) -> type[HorovodRunError]:
    """``cls`` and ``HorovodRunError`` at once, under ``cls``'s name."""
    return type(cls.__name__, (cls, HorovodRunError), {
        "__module__": __name__, "__init__": HorovodRunError.__init__,
        "__doc__": "%s raised in a rank; also a HorovodRunError naming the rank." % cls.__name__,
    })
class DatasetError(ValueError):
    """The ``dataset=`` of a run cannot be trained on (no such table, a query that does not parse,
    too few rows, a column type no adapter takes), or ``runtime.dataset()`` was called in a run
    without one. Raised before any rank starts; the message names the fix."""


class TorchStoreError(HorovodRunError):
    """Under ``launcher="torch"``, rank 0 could not serve torch.distributed's store on the socket its
    task holds, or a rank could not reach that store (``runner/launchers/torch.py``). The message
    names the address and what was wrong."""
