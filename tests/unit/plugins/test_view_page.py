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



def test_a_stalled_try_shows_who_stalled_and_every_ranks_stacks_in_its_failure_panel():
    from airflow_provider_horovod.runner.driver.stalls import StallWatch
    from airflow_provider_horovod.runner.events import RankBeat

    watch = StallWatch(4.0, silence_s=2.5)
    watch.start(0.0, ranks=2)
    watch.beat(RankBeat(0, 100, "hvdhost0", 0.0, "waits in allreduce (called at train (job.py:9))",
                        stacks='    > File "job.py", line 9, in train'), 4.5)
    watch.beat(RankBeat(1, 101, "hvdhost1", 0.0, "in user code at sleepy (job.py:52)",
                        stacks='    > File "job.py", line 52, in sleepy\n          time.sleep(3600)'), 4.5)
    error = watch.verdict(5.0).to_json()
    page = _page(status="failed", error=error)
    assert "Failure of rank 1 on hvdhost1" in page
    assert "stalled: rank 1 in user code at sleepy (job.py:52); rank 0 waits in allreduce" in page
    stacks = re.search(r'<pre id="failure-traceback">(.*?)</pre>', page, re.S).group(1)
    assert stacks.startswith("Python stacks at the stall") and "line 52, in sleepy" in stacks
    assert stacks.index("rank 1 (pid 101") < stacks.index("rank 0 (pid 100")  # the stalled rank first


@pytest.mark.parametrize("status, committed", [("running", False), ("failed", True)])
def test_a_try_with_versions_but_no_final_checkpoint_shows_the_versions_not_no_checkpoint(status, committed):
    version = {"seq": 1, "step": 3, "size": 1, "sent": ["model.pt"], "files": {"model.pt": 1}, "uri": "file:///v/000001"}
    page = _page(status=status, committed=committed, versions=[version])
    assert 'id="no-checkpoints"' not in page and 'id="versions"' in page
    said = re.search(r'id="no-final-checkpoint">(.*?)</p>', page).group(1)
    assert ("is running" in said) == (status == "running") and "versions committed" in said
    assert 'id="no-checkpoints">Rank 0 stored no checkpoint' in _page()  # nothing at all: said so
