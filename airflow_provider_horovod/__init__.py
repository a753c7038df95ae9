"""Run Horovod (or plain torch.distributed) training jobs on Spark, in one barrier stage, from Apache Airflow.

The engine (``runner/``, ``HorovodRunner``) imports no Airflow, and neither does ``runtime`` (what
training code imports). The Airflow layer is ``operators``, ``decorators``, ``hooks``, ``plugins``
(the Horovod view), ``links``, ``retry``, the try's recorder (``recorder``), its metrics
(``metrics``) and the artifact store (``store``); ``builder`` builds Horovod itself.
"""

from __future__ import annotations

from airflow_provider_horovod.exceptions import (
    ArtifactError,
    ArtifactSettingsError,
    ClusterSettingsError,
    DatasetError,
    ExecutorMismatchError,
    FixedSlotsError,
    HorovodRunError,
    InsufficientSlotsError,
    Keras3NotSupportedError,
    PayloadError,
    RunCancelledError,
    StallError,
    TrainingStackError,
    WrongLauncherError,
)
__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "ArtifactSettingsError",
    "ClusterSettingsError",
    "DatasetError",
    "ExecutorMismatchError",
    "FixedSlotsError",
    "HorovodRunError",
    "HorovodRunner",
    "InsufficientSlotsError",
    "Keras3NotSupportedError",
    "PayloadError",
    "RunCancelledError",
    "StallError",
    "TrainingStackError",
    "WrongLauncherError",
    "__version__",
]


def __getattr__(name: str):
    # The engine is imported on first use, so that ``python -m airflow_provider_horovod.runner.*``
    # entry points (rank processes, reapers) start without importing it twice.
    if name == "HorovodRunner":
        from airflow_provider_horovod.runner.driver.runner import HorovodRunner

        return HorovodRunner
    raise AttributeError(name)
