"""The Horovod view's page (``plugins/view.py``) for a try without a timeline: what it tells the user."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from airflow_provider_horovod.plugins import view


def _page(**facts: object) -> str:
    facts = {"try_number": 1, "status": "success", "committed": True, "np": 2, "launcher": "mpirun", "duration_s": 3.0,
             "resumed_from": None, "resumed_from_try": None, "resumed_from_step": None, "versions": [],
             "artifacts_uri": "file:///store/d/r/t/try-1", "files": [], "checkpoints": [], "timeline": False,
             "error": None, "attempts": [], **facts}
    selected = SimpleNamespace(number=1, status="success", committed=True)
    return view._PAGE.render(dag_id="d", run_id="r", task_id="t", map_index=-1, tries=[selected], selected=selected,
                             facts=facts, url=lambda *parts, **query: "/".join(parts), roots="file:///store",
                             refresh_s=5, checkpoints=view.CHECKPOINTS, timeline=view.TIMELINE, fmt_size=str)


def _no_timeline_text(launcher: str) -> str:
    return re.search(r'id="no-timeline">(.*?)</p>', _page(launcher=launcher)).group(1)


def test_a_torch_try_is_said_to_have_no_horovod_timeline_and_where_to_profile_instead():
    text = _no_timeline_text("torch")
    assert 'launcher="torch"' in text and "no Horovod timeline" in text and "torch.profiler" in text


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_horovod_try_without_a_timeline_is_told_how_to_record_one(launcher):
    assert "timeline=True" in _no_timeline_text(launcher)


def test_a_try_with_a_restart_shows_a_row_per_attempt_and_a_try_without_shows_none():
    attempts = [
        {"number": 0, "np": 3, "started_s": 0.0, "resumed_from": None, "restart_s": None, "ending": "lost",
         "cause": "rank 1 on 10.0.0.2 was killed by SIGKILL", "duration_s": 40.0},
        {"number": 1, "np": 3, "started_s": 41.0, "resumed_from": {"seq": 4, "step": 120}, "restart_s": 6.2,
         "ending": "success", "cause": None, "duration_s": 30.0},
    ]
    table = re.search(r'<table id="attempts">(.*?)</table>', _page(attempts=attempts), re.S).group(1)
    rows = re.findall(r"<tr><td class=\"num\">(\d)</td>.*?</tr>", table, re.S)
    assert rows == ["0", "1"]
    assert "killed by SIGKILL" in table and "version 4 (step 120)" in table and "6.2 s" in table
    assert 'id="attempts"' not in _page()

