"""The ranks, mpirun and orted start without the task's secrets: Spark's, Airflow's, cloud
credentials and anything named like a secret (``names.is_secret_env``); the user's ``env=`` still
passes. Finding N16 of issue #21."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.runner.names import is_secret_env
from tests.security import rank_jobs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

SECRETS = {
    "_SPARK_AUTH_SECRET": "spark-rpc", "PYTHON_WORKER_FACTORY_SECRET": "worker", "AWS_ACCESS_KEY_ID": "AKIA",
    "AWS_SECRET_ACCESS_KEY": "aws", "AWS_SESSION_TOKEN": "sts", "AZURE_CLIENT_SECRET": "az", "HF_TOKEN": "hf",
    "GITHUB_TOKEN": "gh", "AIRFLOW_CONN_WAREHOUSE": "postgresql://u:pw@db/x", "AIRFLOW_VAR_API": "v",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt", "AIRFLOW__CORE__FERNET_KEY": "fernet",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:pw@db/airflow", "DB_PASSWORD": "pw",
    "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json", "OPENAI_API_KEY": "sk",
}
ORDINARY = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "SECRETARY_NAME": "x"}


@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_a_rank_starts_without_the_tasks_secrets_and_with_what_env_gives(monkeypatch, launcher):
    for name, value in {**SECRETS, **ORDINARY}.items():
        monkeypatch.setenv(name, value)
    env = HorovodRunner(-1, launcher=launcher, env={"AWS_PROFILE": "training", "HF_TOKEN": "given"}).run(
        rank_jobs.environment_job)
    assert sorted(name for name in SECRETS if name in env) == ["HF_TOKEN"]  # the review: all of them reached the ranks
    assert env["HF_TOKEN"] == "given" and env["AWS_PROFILE"] == "training"  # what env= says, as given
    assert {name: env.get(name) for name in ORDINARY} == ORDINARY


def test_the_deny_list_takes_secret_words_not_lookalikes():
    assert all(is_secret_env(name) for name in SECRETS)
    assert not any(is_secret_env(name) for name in [*ORDINARY, "PATH", "HVDRUNNER_PLAN", "SPARK_HOME", "CUDA_VISIBLE_DEVICES"])
