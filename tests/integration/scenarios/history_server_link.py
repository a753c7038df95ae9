"""The "Spark UI" link of a connection that names a History Server: a fresh SparkSession with
Spark's event log on, one job, the link the hook gives, then the session stops (as the task's does).

usage: python -m tests.integration.scenarios.history_server_link CONN_ID OUT_JSON
(the connection comes from AIRFLOW_CONN_<CONN_ID>)
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

    hook = HorovodRunnerHook(sys.argv[1], app_name="hvd-history-link")
    session = hook.get_conn()
    try:
        url = hook.history_server_url(session)
        app_id = session.sparkContext.applicationId
        assert session.range(100).count() == 100
    finally:
        hook.stop_session()
    with open(sys.argv[2], "w") as f:
        json.dump({"url": url, "app_id": app_id}, f)


if __name__ == "__main__":
    main()
