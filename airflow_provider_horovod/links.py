"""Extra links of HorovodRunnerOperator, backed by XCom: the task pushes each URL as soon as it knows it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey


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
    """The Spark UI of the application that ran the Horovod job."""

    name = "Spark UI"
    xcom_key = "horovod_spark_ui_url"


class HorovodTimelineLink(_XComLink):
    """The stored Horovod timeline: its summary picture when there is one, else the Chrome-trace JSON."""

    name = "Horovod timeline"
    xcom_key = "horovod_timeline_url"
