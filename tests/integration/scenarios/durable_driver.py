"""A driver that trains with durable checkpoints until it is killed (SIGKILL: nothing runs after).

usage: python -m tests.integration.scenarios.durable_driver LAUNCHER ARTIFACT_DIR MARKER
"""

from __future__ import annotations

import sys


def main() -> None:
    launcher, artifact_dir, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    from airflow_provider_horovod import HorovodRunner
    from tests.integration import jobs

    HorovodRunner(-2, launcher=launcher, artifact_dir=artifact_dir).run(jobs.durable_job, steps=100000, pause=0.3,
                                                                         marker=marker)


if __name__ == "__main__":
    main()
