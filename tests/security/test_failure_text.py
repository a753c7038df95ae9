"""A failing rank's message, traceback, last lines and mpirun's words reach the task log escaped,
as streamed rank lines do: none of them starts a record of its own. Finding N8 of issue #21."""

from __future__ import annotations

import pytest

from airflow_provider_horovod import HorovodRunError, HorovodRunner
from airflow_provider_horovod.runner.driver.attempt import run_error
from airflow_provider_horovod.runner.driver.channel import Channel
from airflow_provider_horovod.runner.events import Failure
from tests.security import rank_jobs
from tests.security.attacker import SECRET

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

RAW = ("\r", "\x1b", "\u2028", "\u2029", "\x85")


def _forged_lines(text: str) -> list[str]:
    """Lines of ``text`` that begin as a record of Airflow's task log would."""
    return [line for line in text.split("\n") if line.startswith("[2026-")]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_cannot_forge_task_log_records_through_the_error(how):
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(-1, launcher="gloo", driver_log_verbosity="log_callback_only").run(rank_jobs.forged_failure_job,
                                                                                         how=how)
    text = str(info.value)
    assert rank_jobs.FORGED in text  # shown, as the rank's words
    assert _forged_lines(text) == []  # the review: a forged "Marking task as SUCCESS" record
    assert not [c for c in RAW if c in text]
    if how == "raise":
        assert "boom\\x0a[2026-12-04" in text and "ValueError: boom" in info.value.remote_traceback


def test_mpirun_words_and_every_field_of_a_report_are_escaped():
    failure = Failure(message="Rank 0 failed\n%s" % rank_jobs.FORGED, rank=0, host="h\rx", exit="exited\x1b[2K",
                      tail=("ok", rank_jobs.FORGED, "a\u2028b"), launcher_output=(rank_jobs.FORGED, "\x1b]0;title\x07"))
    others = [Failure(message="orted", launcher_output=("x\n" + rank_jobs.FORGED,))]
    error = run_error(failure, Channel(SECRET).tails(), [failure, *others], launcher="mpirun", stall_timeout=600)
    text = str(error)
    assert _forged_lines(text) == [] and not [c for c in RAW if c in text]
    assert text.count(rank_jobs.FORGED) == 4  # each still shown, as the words of a rank or of mpirun
