"""HorovodPlugin: the Horovod view in Airflow's UI, behind Airflow's own login and DAG permissions.

Installing the package is enough. The provider info names the plugin, but Airflow reads the plugins
of providers only with ``[core] lazy_discover_providers = False`` (default ``True``); otherwise it
comes through the ``airflow.plugins`` entry point (:data:`entry_point`), which stands down in the
first case so the plugin is registered once (twice would be reported as a plugin import error).

* ``fastapi_apps``: :mod:`airflow_provider_horovod.plugins.view`, mounted at ``/horovod``;
* ``external_views``: a "Horovod" tab on every task-instance page (destination ``task_instance``)
  that shows that page in the UI, for the try picked there. The UI uses the tab's ``href`` as it
  is, so it carries the path of ``[api] base_url`` (``https://host/airflow/`` → ``/airflow/horovod/...``):
  behind a path prefix the tab opens the view, not the UI's "page not found".

The app is built on first use, in the API server only: other Airflow processes load this plugin
without importing FastAPI or the API server's security code.

.. seealso:: ``docs/how-to.md`` (section "The Horovod view")
"""

from __future__ import annotations

from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from airflow.plugins_manager import AirflowPlugin

from airflow_provider_horovod.links import VIEW_ROUTE

URL_PREFIX = "/horovod"
URL_ROUTE = VIEW_ROUTE  # the UI's tab: /dags/<dag>/runs/<run>/tasks/<task>/plugin/horovod
VIEW_PATH = URL_PREFIX + "/dags/{DAG_ID}/runs/{RUN_ID}/tasks/{TASK_ID}?map_index={MAP_INDEX}"


def view_href() -> str:
    """The tab's ``href``: the view's path under the path of ``[api] base_url`` (as the API server
    mounts every app under it)."""
    from airflow.configuration import conf

    root = urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")
    return root + VIEW_PATH


class HorovodPlugin(AirflowPlugin):
    """The Horovod view: per try of a task instance, its timeline, checkpoints and failure."""

    name = "horovod"
    external_views = [
        {
            "name": "Horovod",
            "href": view_href(),
            "destination": "task_instance",
            "url_route": URL_ROUTE,
        }
    ]

    @cached_property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from airflow_provider_horovod.plugins.view import create_app

        return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Horovod view"}]


def _entry_point() -> type[HorovodPlugin] | None:
    from airflow.configuration import conf

    return HorovodPlugin if conf.getboolean("core", "lazy_discover_providers", fallback=True) else None


entry_point = _entry_point()
