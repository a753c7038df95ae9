"""Run Horovod training jobs on Spark, in one barrier stage, from Apache Airflow.

The engine (``HorovodRunner``) imports no Airflow; the Airflow layer lives in ``hooks``,
``operators`` and ``decorators``.
"""

from __future__ import annotations

from airflow_provider_horovod.exceptions import (
    ArtifactError,
    HorovodRunError,
    InsufficientSlotsError,
    PayloadError,
    RunCancelledError,
)
from airflow_provider_horovod.runner.runner import HorovodRunner

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "HorovodRunError",
    "HorovodRunner",
    "InsufficientSlotsError",
    "PayloadError",
    "RunCancelledError",
    "__version__",
]
