"""TensorFlow training functions on real Spark, real Horovod ranks and real mpirun / Gloo.

Needs the ``tensorflow`` extra and a Horovod built with TensorFlow (``scripts/setup --with
tensorflow``; ``scripts/test`` asks for both). Each run imports TensorFlow in every rank, the slow
part, so each run checks as much as reads well.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from airflow_provider_horovod.exceptions import HorovodRunError
from airflow_provider_horovod.runner.driver.runner import HorovodRunner
from tests.integration import tensorflow_jobs


def _horovod_has_tensorflow() -> bool:
    horovod = importlib.util.find_spec("horovod")
    if horovod is None or importlib.util.find_spec("tensorflow") is None:
        return False
    return any(Path(p, "tensorflow").glob("mpi_lib*.so") for p in horovod.submodule_search_locations)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("no_leftover_processes"),
    pytest.mark.skipif(not _horovod_has_tensorflow(),
                       reason="needs the tensorflow extra and Horovod built with it: scripts/setup --with tensorflow"),
]


@pytest.mark.parametrize(("np_", "launcher"), [(2, "mpirun"), (2, "gloo"), (-2, "mpirun")],
                         ids=["mpirun-np2", "gloo-np2", "local-np-2"])
def test_keras_and_gradient_tape_keep_ranks_in_sync_under_every_launcher(request, np_, launcher):
    spark = request.getfixturevalue("spark") if np_ > 0 else None
    ranks = HorovodRunner(np_, launcher=launcher, spark=spark).run(tensorflow_jobs.keras_and_gradient_tape_job)

    assert [r["rank"] for r in ranks] == [0, 1] and {r["size"] for r in ranks} == {2}
    assert {r["controller"] for r in ranks} == {"mpi" if launcher == "mpirun" else "gloo"}
    # the runner gave every rank Keras 2: tf.keras is tf-keras
    assert {r["tf_use_legacy_keras"] for r in ranks} == {"1"}
    assert {r["keras_module"].split(".")[0] for r in ranks} == {"tf_keras"}
    # each rank began from its own weights and trained on its own data: equal only if Horovod broadcast
    # rank 0's weights and averaged the gradients (Keras 3 ends here with different weights)
    for name in ("keras_weights", "tape_weights"):
        for mine, other in zip(ranks[0][name], ranks[1][name], strict=True):
            assert np.allclose(mine, other, rtol=0, atol=1e-6), name
    assert ranks[0]["keras_accuracy"] == ranks[1]["keras_accuracy"]  # MetricAverageCallback: the mean over ranks
    losses = ranks[0]["tape_losses"]
    assert losses == ranks[1]["tape_losses"] and losses[-1] < losses[0]  # it trained


def test_keras_3_training_function_fails_fast_with_the_fix_in_the_error():
    with pytest.raises(HorovodRunError) as failed:
        HorovodRunner(-2).run(tensorflow_jobs.keras3_job)
    error = str(failed.value)
    assert "Keras3NotSupportedError" in error
    assert "horovod.tensorflow.keras.DistributedOptimizer was given a Keras 3 object" in error
    assert "does not average gradients across ranks" in error
    assert "tf.keras" in error and "hvd.DistributedGradientTape" in error  # the two ways out
    # raised by the DistributedOptimizer call itself, before the model was compiled or trained
    frames = [line.strip() for line in failed.value.remote_traceback.splitlines() if line.strip().startswith("File ")]
    assert frames[-3].endswith("in keras3_job") and frames[-2].endswith("in checked"), frames
    printed = [line for lines in failed.value.log_tail.values() for line in lines]
    assert not [line for line in printed if "wrapped a Keras 3 optimizer" in line]
