"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-horovod",
        "name": "Horovod",
        "description": "Run Horovod training jobs on Spark, in one barrier stage, from Apache Airflow.",
        "versions": ["0.1.0"],
    }
