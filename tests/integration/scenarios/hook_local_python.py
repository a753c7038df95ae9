"""One np=2 job through HorovodRunnerHook on a `spark` connection with a local master, in a process
whose environment names no executor Python (no PYSPARK_PYTHON); then the next task's hook of the same
process (as under ``airflow dags test``) with other Spark conf, and one with conf only a new JVM could apply.

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

    # the first task's conf starts the JVM: spark-submit makes each key a Java system property of it
    hook = HorovodRunnerHook(sys.argv[1], spark_conf={"spark.ui.enabled": "false", "spark.task.maxFailures": "7"})
    other = HorovodRunnerHook(sys.argv[1], spark_conf={"spark.ui.enabled": "false"})
    try:
        result, _ = hook.run(rank_python, np=2, start_timeout=60)
        first = hook.get_conn()
        conf = first.conf.get("spark.pyspark.python", None)
        # the next task of this process (airflow dags test) without that conf: its own session, with its own
        # conf only (nothing of the first task's), the first one stopped
        second = other.get_conn()
        same = HorovodRunnerHook(sys.argv[1], spark_conf={"spark.ui.enabled": "false"})
        next_task = {"fresh": second is not first, "first_stopped": first.sparkContext._jsc is None,
                     "conf": second.sparkContext.getConf().get("spark.task.maxFailures"),
                     "reused_when_the_same": same.get_conn() is second}
        # conf that only a new JVM could apply is refused, naming it
        try:
            HorovodRunnerHook(sys.argv[1], spark_conf={"spark.ui.enabled": "false", "spark.driver.memory": "3g"}).get_conn()
            next_task["jvm_conf"] = "accepted"
        except Exception as err:  # noqa: BLE001 - the scenario reports what it saw
            next_task["jvm_conf"] = "%s: %s" % (type(err).__name__, err)
    finally:
        other.stop_session()
    with open(sys.argv[2], "w") as f:
        json.dump({"rank_python": result, "conf": conf, "next_task": next_task}, f)


if __name__ == "__main__":
    main()
