"""Keras 3 objects are refused by Horovod's Keras API in a rank process; Keras 2 (tf-keras) objects pass.

The checks with TensorFlow run in a subprocess, as a rank would (TensorFlow reads
``TF_USE_LEGACY_KERAS`` once, at its first import, so it cannot share the test process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from airflow_provider_horovod.runner.rank import keras_guard

CHECKS = r"""
import json
import horovod.tensorflow.keras as hvd  # imported before install(): the guard must still reach it
import keras
import numpy as np
import tensorflow as tf

from airflow_provider_horovod.exceptions import Keras3NotSupportedError
from airflow_provider_horovod.runner.rank import keras_guard

keras_guard.install()
hvd.init()
x, y = np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32")
seen = {}


def attempt(name, fn):
    try:
        fn()
        seen[name] = "ok"
    except Keras3NotSupportedError as err:
        seen[name] = str(err)


def fit(model, optimizer, callback):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, epochs=1, verbose=0, callbacks=[callback])


k3 = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
k2 = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
attempt("Keras 3 optimizer", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
attempt("Keras 3 model in fit", lambda: fit(k3, keras.optimizers.SGD(0.1), hvd.callbacks.BroadcastGlobalVariablesCallback(0)))
attempt("tf.keras optimizer and model", lambda: fit(k2, hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                                                    hvd.callbacks.MetricAverageCallback()))
print(json.dumps(seen))
"""


def test_installing_the_guard_imports_nothing_heavy():
    before = list(sys.meta_path)
    try:
        keras_guard.install()
        keras_guard.install()  # idempotent
        added = [f for f in sys.meta_path if f not in before]
        assert len(added) == 1
        assert "tensorflow" not in sys.modules and "horovod.tensorflow.keras" not in sys.modules
    finally:
        sys.meta_path[:] = before


def test_only_keras_3_objects_count_as_keras_3():
    assert keras_guard.keras3_class(object()) is None
    assert keras_guard.keras3_class([1, 2]) is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="needs scripts/setup --with tensorflow")
def test_keras_3_objects_are_refused_and_tf_keras_objects_train():
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["tf.keras optimizer and model"] == "ok"
    assert seen["Keras 3 optimizer"].startswith(
        "horovod.tensorflow.keras.DistributedOptimizer was given a Keras 3 object, keras.src.optimizers")
    assert seen["Keras 3 model in fit"].startswith(
        "horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback was given a Keras 3 object, keras.")
    for message in (seen["Keras 3 optimizer"], seen["Keras 3 model in fit"]):
        assert "does not average gradients across ranks" in message
        assert "tf.keras" in message and "tf.GradientTape + hvd.DistributedGradientTape" in message
        assert "TF_USE_LEGACY_KERAS is" not in message  # it is 1 here: no word about it
