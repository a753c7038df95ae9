"""Extra links: "Horovod timeline" opens the Horovod tab of the task instance in the UI."""

from __future__ import annotations

from types import SimpleNamespace

from airflow_provider_horovod.links import HorovodTimelineLink
from airflow_provider_horovod.plugins.horovod import URL_ROUTE, HorovodPlugin


def ti(map_index: int = -1) -> SimpleNamespace:
    return SimpleNamespace(dag_id="train_dag", run_id="manual__2026-01-01T00:00:00+00:00", task_id="train", map_index=map_index)


def test_timeline_link_is_the_ui_route_of_the_plugin_tab(monkeypatch):
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    assert HorovodTimelineLink.view_url(ti()) == (
        "/dags/train_dag/runs/manual__2026-01-01T00%3A00%3A00%2B00%3A00/tasks/train/plugin/" + URL_ROUTE)
    assert HorovodTimelineLink.view_url(ti(4)).endswith("/tasks/train/mapped/4/plugin/%s" % URL_ROUTE)


def test_timeline_link_is_absolute_with_the_api_base_url(monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/")
    assert HorovodTimelineLink.view_url(ti()).startswith("https://airflow.example.com/dags/train_dag/runs/")


def test_plugin_tab_is_on_the_task_instance_page_and_its_href_is_the_mounted_app():
    view = HorovodPlugin.external_views[0]
    assert (view["destination"], view["url_route"]) == ("task_instance", URL_ROUTE)
    assert view["href"].startswith("/horovod/dags/{DAG_ID}/runs/{RUN_ID}/tasks/{TASK_ID}")
