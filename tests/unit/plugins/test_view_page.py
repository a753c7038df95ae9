"""The Horovod view's page (``plugins/view.py``) for a try without a timeline: what it tells the user."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from airflow_provider_horovod.plugins import view


def _no_timeline_text(launcher: str) -> str:
    facts = {"try_number": 1, "status": "success", "committed": True, "np": 2, "launcher": launcher, "duration_s": 3.0,
             "resumed_from": None, "resumed_from_try": None, "resumed_from_step": None, "versions": [],
             "artifacts_uri": "file:///store/d/r/t/try-1", "files": [], "checkpoints": [], "timeline": False,
             "error": None}
    selected = SimpleNamespace(number=1, status="success", committed=True)
    body = view._PAGE.render(dag_id="d", run_id="r", task_id="t", map_index=-1, tries=[selected], selected=selected,
                             facts=facts, url=lambda *parts, **query: "/".join(parts), roots="file:///store",
                             refresh_s=5, checkpoints=view.CHECKPOINTS, timeline=view.TIMELINE, fmt_size=str)
    return re.search(r'id="no-timeline">(.*?)</p>', body).group(1)


def test_a_torch_try_is_said_to_have_no_horovod_timeline_and_where_to_profile_instead():
    text = _no_timeline_text("torch")
    assert 'launcher="torch"' in text and "no Horovod timeline" in text and "torch.profiler" in text


@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_a_horovod_try_without_a_timeline_is_told_how_to_record_one(launcher):
    assert "timeline=True" in _no_timeline_text(launcher)
