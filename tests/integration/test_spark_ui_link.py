"""The "Spark UI" link points at a real Spark History Server, where the application outlives the task."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyspark
import pytest

from tests.integration.cluster import free_port

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def history_server(tmp_path):
    """Spark's own History Server (from PySpark's jars), reading ``tmp_path/events``."""
    events = tmp_path / "events"
    events.mkdir()
    port = free_port()
    spark_home = Path(pyspark.__file__).parent
    opts = "-Dspark.history.fs.logDirectory=file:%s -Dspark.history.ui.port=%d -Dspark.history.fs.update.interval=1s" % (events, port)
    env = dict(os.environ, SPARK_HOME=str(spark_home), SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1",
               SPARK_HISTORY_OPTS=opts)
    log = (tmp_path / "history-server.log").open("wb")
    proc = subprocess.Popen([str(spark_home / "bin" / "spark-class"), "org.apache.spark.deploy.history.HistoryServer"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        yield "http://127.0.0.1:%d" % port, events
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_spark_ui_link_opens_the_finished_application_on_the_history_server(history_server, tmp_path):
    url, events = history_server
    extras = {"history_server_url": url + "/", "spark.eventLog.enabled": "true", "spark.eventLog.dir": "file:%s" % events,
              "spark.ui.enabled": "false"}
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPARK_LOCAL_IP="127.0.0.1",
               AIRFLOW_CONN_SPARK_HISTORY=json.dumps({"conn_type": "spark", "host": "local[1]", "extra": extras}))
    out = tmp_path / "link.json"
    proc = subprocess.run([sys.executable, "-m", "tests.integration.scenarios.history_server_link", "spark_history", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    assert got["url"] == "%s/history/%s/jobs/" % (url, got["app_id"])

    deadline = time.monotonic() + 90  # the session is gone; the History Server shows it once it has read the log
    while True:
        try:
            page = httpx.get(got["url"], timeout=10, follow_redirects=True)
            if page.status_code == 200 and "hvd-history-link" in page.text:
                break
        except httpx.HTTPError:
            page = None
        assert time.monotonic() < deadline, "the History Server never showed %s: %s" % (
            got["url"], (tmp_path / "history-server.log").read_text()[-3000:])
        time.sleep(1)
    assert "Completed Jobs (1)" in page.text  # the job the session ran
