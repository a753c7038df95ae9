"""The ranks, mpirun and orted start with an allow-list of the task's environment (``names.
passes_to_ranks``): what they and the frameworks need, never a name that holds a secret; the
user's ``env=`` still passes, and ``HVDRUNNER_PASS_ENV`` names more. Finding N16 of issue #21, and
its residual in issue 40 (a deny-list by name let ``PGPASSWORD``, ``DATABASE_URL`` & co through)."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunner
from airflow_provider_horovod.runner.names import is_secret_env, passes_to_ranks
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
UNNAMED_SECRETS = {  # secrets whose names a deny-list by words does not catch (issue 40, N16)
    "PGPASSWORD": "pg", "MYSQL_PWD": "my", "DATABASE_URL": "postgresql://u:pw@db/x", "REDIS_URL": "redis://:pw@r",
    "AIRFLOW__CORE__SQL_ALCHEMY_CONN": "postgresql://u:pw@db/af", "DB_PASS": "pw", "KAGGLE_KEY": "k",
    "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock", "MLFLOW_TRACKING_USERNAME": "ml", "HF_TOKEN": "hf-of-the-executor",
}
ORDINARY = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "LC_ALL": "C.UTF-8", "NCCL_DEBUG": "WARN",
            "CUDA_MODULE_LOADING": "LAZY"}
PASSED = {"SITE_CA_BUNDLE": "/etc/site/ca.pem", "SECRETARY_NAME": "x"}  # named in HVDRUNNER_PASS_ENV


@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_a_rank_starts_without_the_tasks_secrets_and_with_what_env_gives(monkeypatch, launcher):
    for name, value in {**SECRETS, **UNNAMED_SECRETS, **ORDINARY, **PASSED}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HVDRUNNER_PASS_ENV", "SITE_*, SECRETARY_NAME")
    env = HorovodRunner(-1, launcher=launcher, env={"AWS_PROFILE": "training", "HF_TOKEN": "given"}).run(
        rank_jobs.environment_job)
    leaked = sorted(name for name in {**SECRETS, **UNNAMED_SECRETS} if name in env)
    assert leaked == ["HF_TOKEN"]  # the review: all of them reached the ranks
    assert env["HF_TOKEN"] == "given" and env["AWS_PROFILE"] == "training"  # what env= says, as given
    assert {name: env.get(name) for name in {**ORDINARY, **PASSED}} == {**ORDINARY, **PASSED}


def test_the_allow_list_takes_what_ranks_need_and_no_secret_even_when_its_prefix_is_allowed():
    assert all(passes_to_ranks(name) for name in [*ORDINARY, "PATH", "HOME", "LANG", "PYTHONPATH", "HVDRUNNER_PLAN",
                                                  "CUDA_VISIBLE_DEVICES", "OMPI_MCA_btl", "LD_LIBRARY_PATH",
                                                  "AIRFLOW_CTX_DAG_ID", "AIRFLOW_CTX_TRY_NUMBER"])
    assert not any(passes_to_ranks(name) for name in [*SECRETS, *UNNAMED_SECRETS, "SPARK_HOME", "SECRETARY_NAME"])
    assert passes_to_ranks("SECRETARY_NAME", "FOO, SECRETARY_NAME") and passes_to_ranks("SITE_X", "SITE_*")
    assert not passes_to_ranks("PYTHON_WORKER_FACTORY_SECRET", "*")  # Spark's own secret never passes


def test_the_deny_list_takes_secret_words_not_lookalikes():
    assert all(is_secret_env(name) for name in SECRETS)
    assert not any(is_secret_env(name) for name in ["TOKENIZERS_PARALLELISM", "SECRETARY_NAME", "PATH", "HVDRUNNER_PLAN",
                                                    "SPARK_HOME", "CUDA_VISIBLE_DEVICES"])
