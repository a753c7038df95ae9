"""The real Airflow deployment and the browser logged in to it, for the tests of this package only:
they are package-scoped, so the deployment (PostgreSQL, four Airflow services, a four-worker Spark
cluster, Chromium) is torn down as soon as the package's last test ends instead of taking CPU from
the rest of the suite."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.browser import logged_in_browser
from tests.integration.cluster import StandaloneCluster
from tests.integration.deployment import REPO, Deployment

# Besides the admin, a user the auth manager lets read no DAG (no role): the Horovod view's 403 test.
NO_DAG_ACCESS_USER = "no_dag_access"
DEPLOYMENT_ENV = {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,%s:" % NO_DAG_ACCESS_USER}
DEPLOYMENT_DAGS = [*sorted((REPO / "dags").glob("*.py")), *sorted((REPO / "tests/integration/deployment_dags").glob("*.py"))]


# The connection of the DAGs that share one Spark standalone cluster (4 one-core workers; each task's
# application may take 2 cores, so two Horovod jobs run at once and the next ones wait for slots).
SHARED_SPARK_CONN_ID = "spark_shared"
PATH_PREFIX = "/airflow"


@pytest.fixture(scope="package")
def airflow_deployment(tmp_path_factory: pytest.TempPathFactory, s3_server) -> Iterator[Deployment]:
    """PostgreSQL + API server + scheduler + DAG processor + triggerer (LocalExecutor), with the
    example DAGs and ``tests/integration/deployment_dags/``, and a Spark standalone cluster behind the
    ``spark_shared`` connection; torn down after the package's last test. The UI and the APIs are served
    under ``/airflow`` (``[api] base_url``), as behind a reverse proxy: every test that talks to the
    deployment, the browser's included, goes through that prefix.

    The artifact root is local (``file://``); ``deployment.s3_root`` is a bucket of the session's S3
    server (``s3_server``) that a task takes as its own ``artifact_root``: every Airflow process (the
    task processes that write it, the API server whose Horovod view reads it) has its ``aws``
    connection, and the view looks there too (``[horovod] view_extra_roots``)."""
    from tests import s3

    # The cluster's JVMs start while the deployment does (its URL is known before it listens).
    cluster = StandaloneCluster(tmp_path_factory.mktemp("deployment-spark"), workers=4).start(wait=False)
    try:
        shared = {"conn_type": "spark", "host": cluster.master, "extra": {**cluster.app_conf(), "spark.cores.max": "2"}}
        s3_root = s3.uri(s3_server.new_bucket(), "artifacts")
        env = {**DEPLOYMENT_ENV, "AIRFLOW_CONN_%s" % SHARED_SPARK_CONN_ID.upper(): json.dumps(shared),
               "AIRFLOW_CONN_%s" % s3.CONN_ID.upper(): s3_server.connection(), "AIRFLOW__HOROVOD__VIEW_EXTRA_ROOTS": s3_root}
        with Deployment.start(tmp_path_factory.mktemp("deployment"), DEPLOYMENT_DAGS, env, path_prefix=PATH_PREFIX) as deployment:
            cluster.wait_for_workers()
            deployment.shared_spark = cluster
            deployment.s3_root = s3_root
            yield deployment
    finally:
        cluster.stop()


@pytest.fixture(scope="package")
def browser(airflow_deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One headless Chromium for the package, logged in to the deployment as the admin."""
    yield from logged_in_browser(airflow_deployment.base_url, airflow_deployment.password,
                                 tmp_path_factory.mktemp("browser"))
