"""The demo and test deployment (``./scripts/demo --ui``) gives another local user nothing: no
database without its password, no guessable login or token secret, no readable login file.
Finding N4 of issue #21."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from tests.integration.deployment import ADMIN_USER, Deployment, Postgres

pytestmark = pytest.mark.slow


def _psql(pg: Postgres, host: str, password: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
    if password is not None:
        env["PGPASSWORD"] = password
    return subprocess.run([str(pg.bin / "psql"), "-w", "-h", host, "-p", str(pg.port), "-U", "postgres", "-d", "airflow",
                           "-c", "SELECT 1"], env=env, capture_output=True, text=True, timeout=60)


def test_the_database_lets_no_one_in_without_its_password():
    pg = Postgres()
    try:
        pg.start()
        for host in ("127.0.0.1", str(pg.root)):  # over TCP and over its Unix socket
            refused = _psql(pg, host, None)
            assert refused.returncode != 0 and "password" in refused.stderr  # the review: trust auth let anyone in
            assert _psql(pg, host, "guess").returncode != 0
            assert _psql(pg, host, pg.password).returncode == 0
    finally:
        pg.stop()


def test_the_login_and_the_token_secret_are_random_and_the_login_file_private(tmp_path):
    first, second = Deployment(tmp_path / "a", []), Deployment(tmp_path / "b", [])
    try:
        secrets = [(d.password, d.env["AIRFLOW__API_AUTH__JWT_SECRET"]) for d in (first, second)]
        assert secrets[0][0] != secrets[1][0] and secrets[0][1] != secrets[1][1]
        for deployment, (password, jwt_secret) in zip((first, second), secrets):
            port = str(deployment.api_port)
            assert port not in password and port not in jwt_secret  # the review: admin-<port>, hvd-test-<port>
            assert len(password) >= 16 and len(jwt_secret) >= 32
            assert stat.S_IMODE(deployment.root.stat().st_mode) == 0o700
        previous = os.umask(0)  # even a careless umask leaves the login file private
        try:
            first.write_login()
        finally:
            os.umask(previous)
        login = first.home / "passwords.json"
        assert stat.S_IMODE(login.stat().st_mode) == 0o600  # the review: 0644
        assert json.loads(login.read_text()) == {ADMIN_USER: first.password}
        assert first.postgres.password != second.postgres.password
    finally:
        first.postgres.stop()
        second.postgres.stop()


def test_the_plain_demos_folder_is_private_even_when_an_earlier_demo_left_it_open(tmp_path):
    """Issue 40, T4-15: ``./scripts/demo`` (without ``--ui``) left its AIRFLOW_HOME 0755 with a
    world-readable SQLite database (XComs, rendered fields, task state)."""
    home = tmp_path / ".airflow-demo"
    home.mkdir(mode=0o755)
    (home / "airflow.db").write_text("xcoms")
    (home / "airflow.db").chmod(0o644)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "demo_home")
    subprocess.run([script, str(home)], check=True, timeout=30)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "airflow.db").stat().st_mode) == 0o600
    fresh = tmp_path / "fresh"
    subprocess.run([script, str(fresh)], check=True, timeout=30)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    with open(os.path.join(os.path.dirname(script), "demo")) as demo:  # the demo runs it, under umask 077
        text = demo.read()
    assert '"$ROOT/scripts/demo_home" "$AIRFLOW_HOME"' in text and text.index("umask 077") < text.index("demo_home")
