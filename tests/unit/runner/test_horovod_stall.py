"""Horovod's stall check, as the ranks get it from ``stall_timeout``, and its warning read back."""

from __future__ import annotations

from airflow_provider_horovod.runner.horovod_stall import Stall, parse_stall, stall_env, stall_in, whole_seconds

# rank 0's output under mpirun (Horovod 0.28.1), captured from tests/integration/test_stall.py's run
CAPTURED = """[2026-12-04 22:04:37.334348: W /tmp/tmp.DfeAirBB3X/horovod-0.28.1/horovod/common/stall_inspector.cc:107] One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder of ranks for more than 1 seconds. This may indicate that different ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, which will cause deadlock. 
Missing ranks:
0: [allreduce.epoch_loss]
1: [allreduce.grad.fc1]""".splitlines()
# the same report once a tensor waited past the shutdown time: stall_inspector.cc's LOG(ERROR) text
SHUT_DOWN = [CAPTURED[0].replace(": W ", ": E "), "Missing ranks:", "0: [allreduce.epoch_loss]",
             "1!: [allreduce.grad.fc1, allreduce.grad.fc2]",
             'One or more rank (marked by "!") is stalled for longer than 60 seconds. Will shutdown.']


def test_the_stall_timeout_sets_horovods_check_four_times_per_timeout_and_its_shutdown_after_the_drivers_rule():
    assert stall_env(600) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "660"}
    assert stall_env(4)["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "9"  # the driver's verdict and the kill come first
    assert stall_env(20)["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5"
    assert stall_env(2)["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "1"  # never 0: Horovod would check nonstop
    assert whole_seconds(4.2) == 5 and whole_seconds(0.1) == 1


def test_a_captured_warning_names_each_missing_rank_and_its_tensor():
    stall = parse_stall(["training step 3", *CAPTURED])
    assert stall == Stall(missing=((0, ("allreduce.epoch_loss",)), (1, ("allreduce.grad.fc1",))), waited_s=1, shut_down=False)
    assert stall.text == "stalled: rank 0 never submitted allreduce.epoch_loss; rank 1 never submitted allreduce.grad.fc1 (waited 1 s)"


def test_the_shutdown_report_names_every_missing_rank_marked_or_not_and_its_wait():
    stall = stall_in([["rank 1 line"], CAPTURED + SHUT_DOWN])
    assert stall.text == ("stalled: rank 0 never submitted allreduce.epoch_loss; "
                          "rank 1 never submitted allreduce.grad.fc1, allreduce.grad.fc2 (waited 60 s)")
    assert stall.shut_down


def test_output_without_a_stall_report_is_no_stall():
    assert parse_stall(["Missing ranks:", "1: [x]"]) is None
    assert stall_in([[], ["RuntimeError: boom"]]) is None


def test_every_process_of_a_host_gets_the_stall_check_and_the_users_env_wins(tmp_path):
    import dataclasses

    from airflow_provider_horovod.runner.task.barrier import base_env
    from airflow_provider_horovod.runner.names import TaskDir
    from tests.unit.runner.task.test_host import spec

    for launcher in ("mpirun", "gloo"):
        env = base_env(dataclasses.replace(spec(launcher), stall_timeout_s=8), TaskDir(tmp_path))
        assert (env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"], env["HOROVOD_STALL_CHECK_TIME_SECONDS"]) == ("13", "2")
    own = dataclasses.replace(spec(), env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"})
    assert base_env(own, TaskDir(tmp_path))["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "0"


def test_a_stall_timeout_that_is_not_a_positive_number_fails_when_the_dag_is_parsed():
    import pytest

    from airflow_provider_horovod.runner.options import check_options

    for bad in (0, -1, float("inf"), True, "60"):
        with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
            check_options(launcher="gloo", driver_log_verbosity="all", start_timeout=1, max_artifact_bytes=1,
                          max_artifact_files=1, stall_timeout=bad)
