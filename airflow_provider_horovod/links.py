"""Extra links of HorovodRunnerOperator: both open pages that outlive the task.

* "Horovod timeline" opens the Horovod view of this task instance (the provider's plugin: a tab
  on the task-instance page), where every try's timeline, checkpoints and failure are.
* "MLflow run" opens this try's run on the MLflow server of ``mlflow_conn_id``; absent without one.
* "Spark UI" opens the application on the connection's Spark History Server (the extra
  ``history_server_url``, with ``spark.eventLog.enabled``). Without one there is no link: the
  live UI of the task's SparkSession (``:4040``) dies with the task.

Airflow 3 stores each link's URL in XCom under ``xcom_key`` when the task ends (and the task pushes
it earlier, so the link works while it runs); the UI reads it from there and hides an empty one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

VIEW_ROUTE = "horovod"  # the Horovod view's tab: the plugin's ``url_route`` (``plugins/horovod.py``)


class _XComLink(BaseOperatorLink):
    """A link whose whole URL the task pushed to XCom under ``xcom_key``."""

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(key=self.xcom_key, ti_key=ti_key) or ""

    def persist(self, context: Any, url: str | None) -> None:
        """Push ``url`` for this link, ``None`` while it is not known: Airflow reads every link's key
        when the task ends, and a key never pushed logs an ``XCom not found`` error there."""
        context["ti"].xcom_push(key=self.xcom_key, value=url or None)


class SparkUILink(_XComLink):
    """The application on the Spark History Server of the task's connection; absent without one."""

    name = "Spark UI"
    xcom_key = "horovod_spark_ui_url"


class MlflowRunLink(_XComLink):
    """This try's run on the MLflow tracking server of ``mlflow_conn_id``; absent without one."""

    name = "MLflow run"
    xcom_key = "horovod_mlflow_url"


class HorovodTimelineLink(_XComLink):
    """The Horovod view of this task instance in the Airflow UI: timeline, checkpoints, failure per try."""

    name = "Horovod timeline"
    xcom_key = "horovod_timeline_url"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return self.view_url(ti_key)

    @staticmethod
    def view_url(ti: Any) -> str:
        """The UI's URL of the Horovod tab of task instance ``ti`` (anything with dag_id, run_id,
        task_id, map_index): absolute when ``[api] base_url`` is set, else from the UI's root."""
        from airflow.sdk import conf

        base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
        path = "/dags/%s/runs/%s/tasks/%s" % (quote(ti.dag_id, safe=""), quote(ti.run_id, safe=""), quote(ti.task_id, safe=""))
        map_index = getattr(ti, "map_index", -1)
        if isinstance(map_index, int) and map_index >= 0:
            path += "/mapped/%d" % map_index
        return "%s%s/plugin/%s" % (base, path, VIEW_ROUTE)
