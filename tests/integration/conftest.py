"""Fixtures of the integration tests: the real Airflow deployment (one per test session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.deployment import REPO, Deployment

# Besides the admin, a user the auth manager lets read no DAG (no role): the Horovod view's 403 test.
NO_DAG_ACCESS_USER = "no_dag_access"
DEPLOYMENT_ENV = {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,%s:" % NO_DAG_ACCESS_USER}
DEPLOYMENT_DAGS = [*sorted((REPO / "dags").glob("*.py")), *sorted((REPO / "tests/integration/deployment_dags").glob("*.py"))]


@pytest.fixture(scope="session")
def airflow_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """PostgreSQL + API server + scheduler + DAG processor + triggerer (LocalExecutor), with the
    example DAGs and ``tests/integration/deployment_dags/``; torn down at the end of the session."""
    with Deployment.start(tmp_path_factory.mktemp("deployment"), DEPLOYMENT_DAGS, DEPLOYMENT_ENV) as deployment:
        yield deployment
