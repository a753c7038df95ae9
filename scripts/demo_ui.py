"""``./scripts/demo --ui``: a local Airflow (the tests' deployment), the example DAG run once, and the
URL and login of its Horovod view. Ctrl-C stops every process and removes the database."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.deployment import ADMIN_USER, Deployment  # noqa: E402

DAG, TASK = "horovod_digits_train", "train"


def main() -> int:
    home = ROOT / ".airflow-demo-ui"
    home.mkdir(exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print("[demo] starting PostgreSQL, the API server, scheduler, DAG processor and triggerer (about a minute)", flush=True)
    with Deployment.start(Path(home), sorted((ROOT / "dags").glob("*.py"))) as airflow:
        api = airflow.api
        api.wait_dags([DAG])
        run_id = api.trigger(DAG)
        print("[demo] Airflow is up at %s; running %s (run %s, about a minute)" % (airflow.base_url, DAG, run_id), flush=True)
        state = api.wait_run(DAG, run_id, timeout=900)
        view = "%s/dags/%s/runs/%s/tasks/%s/plugin/horovod" % (airflow.base_url, DAG, quote(run_id, safe=""), TASK)
        print("[demo] the run finished: %s" % state)
        print("[demo] the Horovod view of this run:  %s" % view)
        print("[demo] log in as:                     %s / %s" % (ADMIN_USER, airflow.password))
        print("[demo] process logs: %s; Ctrl-C stops everything" % airflow.logs, flush=True)
        try:
            while all(proc.poll() is None for proc in airflow.procs.values()):
                time.sleep(1)
            print("[demo] an Airflow process exited; see %s" % airflow.logs, file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\n[demo] stopping", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
