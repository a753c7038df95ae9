"""The engine's options that are checked without Spark or Horovod, so an operator can check them
when its DAG is parsed (importing this module imports nothing heavy)."""

from __future__ import annotations

import os

from airflow_provider_horovod.runner.launchers import Launcher, facts_of  # noqa: F401 - Launcher: its callers import it here

VERBOSITIES = ("all", "log_callback_only")
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_LAST_CALL_S = 30.0  # a restart with min_np slots waits this long for the rest (torchrun's elastic "last call")
# a collective some rank never joins ends the run after this long: longer than any honest wait of
# one rank for another (rank 0 saving or evaluating), far shorter than an execution_timeout
DEFAULT_STALL_TIMEOUT_S = 600.0
DEFAULT_PROGRESS_INTERVAL_S = 30.0  # the operator's progress_interval, [horovod] progress_interval
DEFAULT_KEEP = 2  # keep_checkpoints: the newest versions a run (a try) keeps


def check_options(*, launcher: str, driver_log_verbosity: str, start_timeout: float,
                  max_artifact_bytes: int, max_artifact_files: int, timeline: bool = False,
                  stall_timeout: float = DEFAULT_STALL_TIMEOUT_S) -> None:
    """The engine's options that are checked without Spark: a ``ValueError`` that names the fix.

    ``HorovodRunner`` checks them when it is made; the operator when the DAG is parsed.
    """
    if launcher not in list(Launcher):
        raise ValueError("launcher must be one of %s; got %r" % (", ".join(Launcher), launcher))
    if driver_log_verbosity not in VERBOSITIES:
        raise ValueError("driver_log_verbosity must be one of %s; got %r" % (", ".join(VERBOSITIES), driver_log_verbosity))
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not 0 < start_timeout < float("inf"):
        raise ValueError("start_timeout must be a positive number of seconds; got %r" % (start_timeout,))
    if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, (int, float)) or not 0 < stall_timeout < float("inf"):
        raise ValueError("stall_timeout must be a positive number of seconds; got %r" % (stall_timeout,))
    for name, value in (("max_artifact_bytes", max_artifact_bytes), ("max_artifact_files", max_artifact_files)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("%s must be a positive int; got %r" % (name, value))
    if not isinstance(timeline, bool):
        raise ValueError("timeline must be True or False; got %r" % (timeline,))
    if timeline and not facts_of(launcher).runs_horovod:
        raise ValueError("timeline=True records a Horovod timeline, and launcher=%r runs no Horovod. Leave timeline "
                         "off, and %s." % (str(launcher), facts_of(launcher).no_timeline_hint))


def check_keep(keep: object) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError("keep_checkpoints must be an int >= 1 (the newest versions kept per try); got %r" % (keep,))
    return keep


def check_restarts(max_restarts: object, min_np: object, np: object = None) -> None:
    """``max_restarts`` (attempts after one that lost infrastructure) and ``min_np`` (the fewest
    barrier tasks a restart runs on): a ``ValueError`` that names the fix. ``np``: when known (an
    int), ``min_np`` must not exceed it."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError("max_restarts must be an int >= 0 (0: a lost executor fails the run); got %r" % (max_restarts,))
    if min_np is None:
        return
    if isinstance(min_np, bool) or not isinstance(min_np, int) or min_np < 1:
        raise ValueError("min_np must be an int >= 1 (the fewest barrier tasks a restart runs on), or None for np; "
                         "got %r" % (min_np,))
    if isinstance(np, int) and not isinstance(np, bool):
        if np < 0:
            raise ValueError("min_np needs np > 0: np < 0 runs local processes, whose number never shrinks")
        if min_np > np:
            raise ValueError("min_np=%d is more than np=%d; give min_np <= np" % (min_np, np))


def check_last_call(last_call: object) -> float:
    """``last_call``: seconds a restart that has ``min_np`` slots waits for the rest (``>= 0``)."""
    if isinstance(last_call, bool) or not isinstance(last_call, (int, float)) or not 0 <= last_call < float("inf"):
        raise ValueError("last_call must be a number of seconds >= 0 (how long a restart that has min_np slots waits "
                         "for the rest; 0: start at once); got %r" % (last_call,))
    return float(last_call)


def check_engine_values(*, spark: object = None, artifact_dir: object = None, on_checkpoint: object = None,
                        on_report: object = None) -> None:
    """The engine's values of a kind that would be accepted now and fail later: a ``TypeError`` or
    ``ValueError`` that names the fix, when ``HorovodRunner`` is made."""
    for name, value in (("on_checkpoint", on_checkpoint), ("on_report", on_report)):
        if value is not None and not callable(value):
            raise TypeError("%s must be a function (or None); got %r (a %s). Pass the function itself, not its name "
                            "or what it returns." % (name, value, type(value).__name__))
    if spark is not None and not callable(getattr(spark, "createDataFrame", None)):
        raise TypeError("spark must be a SparkSession (or None for the active one); got a %s. For a SparkContext sc, "
                        "pass SparkSession(sc) (or SparkSession.builder.getOrCreate())." % type(spark).__name__)
    folder = os.fspath(artifact_dir) if isinstance(artifact_dir, (str, os.PathLike)) else None
    if isinstance(folder, str) and ("://" in folder or _url_like(folder)):
        raise ValueError("artifact_dir=%r: the engine's artifact_dir is a local folder (an absolute or relative path), "
                         "not a URL. For an object store, run the task with HorovodRunnerOperator's artifact_root "
                         "(s3://conn@bucket/prefix), or copy artifact_dir there after run()." % (folder,))


def _url_like(text: str) -> bool:
    """``s3:/bucket``, ``gs:bucket``: a scheme with fewer than two slashes, which a path would keep as a folder ``s3:``."""
    import re

    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:(?!//)", text) is not None
