"""A run's artifacts stay in its DAG's folder of the store, whatever run_id a user triggers with.
Suspected finding (b) of issue 49, proven: Airflow's default run_id pattern allows ``..``, and a
try of run ``..`` wrote ``<root>/<dag_id>/../<task_id>/try-1``, outside its DAG's folder, where the
view (which refuses ``..``) could never show it."""

from __future__ import annotations

import re

import pytest

from airflow_provider_horovod import store
from airflow_provider_horovod.exceptions import ArtifactError
from airflow_provider_horovod.plugins import store as view_store


def test_airflows_default_run_id_pattern_allows_dot_dot():
    from airflow.configuration import conf

    assert re.match(conf.get("scheduler", "allowed_run_id_pattern"), "..")


@pytest.mark.parametrize("ids", [("train", "..", "train"), ("train", ".", "train"), ("..", "r", "train"),
                                 ("train", "r", "..")])
def test_a_try_whose_ids_leave_the_dags_folder_is_refused_before_anything_is_written(tmp_path, ids):
    dag_id, run_id, task_id = ids
    with pytest.raises(ArtifactError, match="trigger the run with another run_id"):
        store.prepare_try(str(tmp_path), dag_id=dag_id, run_id=run_id, task_id=task_id, try_number=1)
    assert list(tmp_path.iterdir()) == []  # before the fix: <root>/train/try-1, beside every DAG's folder


@pytest.mark.parametrize("value", ["..", ".", "", "a/b", "a\\b", "a\x00b", "x" * 513, "scheduled__2026-12-06T00:00:00+00:00",
                                   "manual__..", "...", "r"])
def test_the_store_writes_by_the_rule_the_view_reads_by(value):
    """What the writer takes, the view shows: one rule (``store.check_id``) for both."""
    try:
        store.check_id(value, "run_id")
        written = True
    except ArtifactError:
        written = False
    try:
        view_store.component(value, "run_id")
        shown = True
    except view_store.BadRequest:
        shown = False
    assert written == shown == (value not in ("..", ".", "") and "/" not in value and "\\" not in value
                                and "\x00" not in value and len(value) <= 512)
