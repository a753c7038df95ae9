"""A real Spark standalone cluster on 127.0.0.1, from PySpark's own ``spark-class``.

One master and two workers, each worker with one core and two simulated GPUs found by a
discovery script (worker A owns GPUs 0 and 1, worker B owns 2 and 3), so each executor is a
separate host to the runner and each task gets its own GPU id.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyspark

from tests import jvm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_script(path: Path, addresses: list[str]) -> Path:
    path.write_text("#!/bin/sh\necho '%s'\n" % json.dumps({"name": "gpu", "addresses": addresses}))
    path.chmod(0o755)
    return path


def stop_process_groups(procs: list[subprocess.Popen]) -> None:
    """TERM each process's group (Spark's launch scripts fork the JVM), then KILL what is still there after 10 s."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class StandaloneCluster:
    def __init__(self, workdir: Path, workers: int = 2, decommission: bool = False) -> None:
        """``decommission``: ``spark.decommission.enabled`` on the workers (SIGPWR to a worker
        decommissions it and its executors) and in ``app_conf()``."""
        self.workdir = workdir
        self.spark_home = Path(pyspark.__file__).parent
        self.port = free_port()
        self.ui_port = free_port()
        self.master = "spark://127.0.0.1:%d" % self.port
        self.procs: list[subprocess.Popen] = []
        self.n_workers = workers
        self.decommission = decommission
        self.app_gpu_script = gpu_script(workdir / "gpus-app.sh", ["0", "1", "2", "3"])

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"SPARK_HOME": str(self.spark_home), "SPARK_LOCAL_IP": "127.0.0.1",
                    "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"})
        env.update(extra or {})
        return env

    def _start(self, args: list[str], name: str, env: dict[str, str]) -> None:
        log = (self.workdir / ("%s.log" % name)).open("wb")
        self.procs.append(subprocess.Popen([str(self.spark_home / "bin" / "spark-class"), *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self, wait: bool = True, workers: int | None = None) -> StandaloneCluster:
        """Start the master and the first ``workers`` workers (all by default; ``start_worker(i)`` the
        rest later); with ``wait=False`` return at once (``wait_for_workers()`` later)."""
        self._start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.port),
                     "--webui-port", str(self.ui_port)], "master", self._env())
        for i in range(self.n_workers if workers is None else workers):
            self.start_worker(i)
        if wait:
            self.wait_for_workers(self.n_workers if workers is None else workers)
        return self

    def start_worker(self, i: int) -> None:
        """Worker ``i``: one core and GPUs ``2i`` and ``2i+1``."""
        script = gpu_script(self.workdir / ("gpus-worker%d.sh" % i), [str(2 * i), str(2 * i + 1)])
        opts = "-Dspark.worker.resource.gpu.amount=2 -Dspark.worker.resource.gpu.discoveryScript=%s" % script
        if self.decommission:
            opts += " -Dspark.decommission.enabled=true"
        work = self.workdir / ("work%d" % i)
        work.mkdir()
        self._start(["org.apache.spark.deploy.worker.Worker", self.master, "--host", "127.0.0.1", "--cores", "1",
                     "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(work)],
                    "worker%d" % i, self._env({"SPARK_WORKER_OPTS": opts}))

    def wait_for_workers(self, workers: int | None = None, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                state = json.load(urllib.request.urlopen("http://127.0.0.1:%d/json/" % self.ui_port, timeout=2))
                alive = sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")
                if alive >= (self.n_workers if workers is None else workers):
                    return
            time.sleep(0.5)
        raise RuntimeError("standalone cluster did not come up; see logs in %s" % self.workdir)

    def applications(self) -> list[dict]:
        """The master's view of every application, running and completed (``name``, ``starttime``, ``duration`` in ms)."""
        state = json.load(urllib.request.urlopen("http://127.0.0.1:%d/json/" % self.ui_port, timeout=5))
        return [*state.get("activeapps", []), *state.get("completedapps", [])]

    def app_conf(self) -> dict[str, str]:
        return {
            **jvm.executor_conf(),
            "spark.executor.cores": "1",
            "spark.executor.memory": "768m",
            "spark.cores.max": str(self.n_workers),
            "spark.executor.resource.gpu.amount": "1",
            "spark.executor.resource.gpu.discoveryScript": str(self.app_gpu_script),
            "spark.task.resource.gpu.amount": "1",
            "spark.ui.enabled": "false",
            **({"spark.decommission.enabled": "true"} if self.decommission else {}),
        }

    def stop(self) -> None:
        stop_process_groups(self.procs)


def app_session(master: str, conf: dict[str, str], name: str):
    """A SparkSession on ``master`` with ``conf`` (a scenario's own application on the cluster)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(name)
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
