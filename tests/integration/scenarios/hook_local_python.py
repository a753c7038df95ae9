"""One np=2 job through HorovodRunnerHook on a `spark` connection with a local master, in a process
whose environment names no executor Python (no PYSPARK_PYTHON).

usage: python tests/integration/scenarios/hook_local_python.py CONN_ID OUT_JSON
(the connection comes from AIRFLOW_CONN_<CONN_ID>; started by path, with no PYTHONPATH)
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from airflow_provider_horovod.hooks.horovod import HorovodRunnerHook

    def rank_python() -> str:
        import sys

        return sys.executable

    hook = HorovodRunnerHook(sys.argv[1], spark_conf={"spark.ui.enabled": "false"})
    try:
        result, _ = hook.run(rank_python, np=2, start_timeout=60)
        conf = hook.get_conn().conf.get("spark.pyspark.python", None)
    finally:
        hook.stop_session()
    with open(sys.argv[2], "w") as f:
        json.dump({"rank_python": result, "conf": conf}, f)


if __name__ == "__main__":
    main()
