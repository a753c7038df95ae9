"""The runner works with Spark's own authentication and encryption turned on (docs/security.md)."""

from __future__ import annotations

import secrets

import pytest

from tests.integration.test_runner import _one_run

pytestmark = pytest.mark.slow


def test_a_job_runs_with_spark_authentication_and_encryption_on(tmp_path):
    got = _one_run(tmp_path, {
        "spark.authenticate": "true",
        "spark.authenticate.secret": secrets.token_hex(16),
        "spark.network.crypto.enabled": "true",
        "spark.io.encryption.enabled": "true",
    })
    assert got["error_type"] is None, got["message"]
    assert got["result"]["sum"] == 3.0
