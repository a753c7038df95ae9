"""Provider metadata, found by Airflow through the ``apache_airflow_provider`` entry point.

The ``spark`` and ``spark_connect`` connection types belong to
``apache-airflow-providers-apache-spark``; this provider reuses them and registers none.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_horovod.runner.options import DEFAULT_PROGRESS_INTERVAL_S


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-horovod",
        "name": "Horovod",
        "description": "Run Horovod training jobs on Spark, in one barrier stage, from Apache Airflow.",
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "Horovod",
                "external-doc-url": "https://horovod.readthedocs.io/",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Horovod",
                "python-modules": ["airflow_provider_horovod.hooks.horovod"],
            }
        ],
        "operators": [
            {
                "integration-name": "Horovod",
                "python-modules": ["airflow_provider_horovod.operators.horovod"],
            }
        ],
        "task-decorators": [
            {
                "name": "horovod",
                "class-name": "airflow_provider_horovod.decorators.horovod.horovod_task",
            }
        ],
        "plugins": [
            {
                "name": "horovod",
                "plugin-class": "airflow_provider_horovod.plugins.horovod.HorovodPlugin",
            }
        ],
        "extra-links": [
            "airflow_provider_horovod.links.SparkUILink",
            "airflow_provider_horovod.links.HorovodTimelineLink",
            "airflow_provider_horovod.links.MlflowRunLink",
        ],
        "config": {
            "horovod": {
                "description": "Settings of the Horovod provider.",
                "options": {
                    "artifact_root": {
                        "description": (
                            "Where HorovodRunnerOperator stores timelines, checkpoints and large results, "
                            "as <artifact_root>/<dag_id>/<run_id>/<task_id>/try-<n>/. Any fsspec URL that "
                            "Airflow's ObjectStoragePath understands (file://, s3://conn_id@bucket/path, ...). "
                            "Empty means a folder named horovod-artifacts under AIRFLOW_HOME; a relative "
                            "local path is taken under AIRFLOW_HOME."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://aws_default@my-bucket/horovod",
                        "default": "",
                    },
                    "view_extra_roots": {
                        "description": (
                            "The Horovod view (a tab on the task-instance page) reads each try's artifacts "
                            "under artifact_root. Tasks that set their own artifact_root elsewhere are shown "
                            "too when that root is listed here (comma-separated URLs). The view never reads "
                            "outside these roots."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://aws_default@my-bucket/other-team/horovod",
                        "default": "",
                    },
                    "resume_extra_roots": {
                        "description": (
                            "HorovodRunnerOperator's resume=<uri> copies that folder to every executor, so it "
                            "must lie under the task's artifact_root. Roots listed here (comma-separated URLs) "
                            "are allowed too, e.g. checkpoints another team's DAG stores elsewhere. Local "
                            "paths are compared after resolving links."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://aws_default@my-bucket/pretrained",
                        "default": "",
                    },
                    "progress_interval": {
                        "description": (
                            "Seconds between two progress lines (step, metrics, steps/s, ETA from "
                            "runtime.report) in a Horovod task's log; the operator's progress_interval "
                            "overrides it."
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "10",
                        "default": "%g" % DEFAULT_PROGRESS_INTERVAL_S,
                    },
                },
            }
        },
    }
