"""``scripts/setup``: the demo's request asks for none of the test-only parts (issue 39, item 8)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY_APT = {"postgresql", "chromium", "chromium-driver"}


def plan(*args: str) -> dict[str, str]:
    """What ``scripts/setup ARGS --dry-run`` says it installs, by line title."""
    done = subprocess.run([str(ROOT / "scripts" / "setup"), *args, "--dry-run"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in done.stdout.splitlines())


@pytest.mark.parametrize("args, extras, test_parts", [
    (("--demo",), "torch,examples", False),
    ((), "test,torch", True),
    (("--with", "tensorflow"), "test,torch,tensorflow", True),
])
def test_only_the_test_set_ups_install_postgresql_chromium_and_the_mlflow_server(args, extras, test_parts):
    said = plan(*args)
    apt = set(said["apt"].split())
    assert {"openmpi-bin", "libopenmpi-dev"} <= apt
    assert (TEST_ONLY_APT <= apt) if test_parts else not (TEST_ONLY_APT & apt)
    assert said["extras"] == extras
    assert said["mlflow server venv"] == ("yes" if test_parts else "no")


def test_the_plain_demo_sets_up_for_the_demo_and_the_ui_demo_for_the_deployment():
    text = (ROOT / "scripts" / "demo").read_text()
    ui = text.index('if [ "${1:-}" = "--ui" ]; then')
    assert text.index('"$ROOT/scripts/setup"\n', ui) < text.index("demo_ui.py", ui)
    assert '"$ROOT/scripts/setup" --demo\n' in text[text.index("fi\n", ui):]


def test_the_demo_and_tensorflow_requests_exclude_each_other():
    done = subprocess.run([str(ROOT / "scripts" / "setup"), "--demo", "--with", "tensorflow", "--dry-run"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "exclude each other" in done.stderr
