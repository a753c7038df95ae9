"""TensorFlow training functions the integration tests run on real Horovod ranks (shipped by value).

Importing TensorFlow costs a rank several seconds on these machines, so one function checks both
of Horovod's TensorFlow APIs in one rank process.
"""

from __future__ import annotations


def keras_and_gradient_tape_job(steps: int = 6) -> list[dict]:
    """Every rank starts from its own random weights and trains on its own data; after Horovod's
    broadcast and gradient averaging all ranks must hold the same weights. Returns every rank's view."""
    import os

    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    tf.keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose: the broadcast must fix it
    rng = np.random.default_rng(hvd.rank())
    x = (rng.normal(size=(96, 4)) + hvd.rank()).astype("float32")  # different data on each rank
    y = (x[:, 0] + x[:, 1] > 2 * hvd.rank()).astype("int64")

    def model():
        return tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(8, activation="relu"),
                                    tf.keras.layers.Dense(2)])

    # 1. horovod.tensorflow.keras: DistributedOptimizer + BroadcastGlobalVariablesCallback + MetricAverageCallback
    keras_model = model()
    keras_model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)),
                        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = keras_model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])

    # 2. horovod.tensorflow: GradientTape + DistributedGradientTape + broadcast_variables
    tape_model = model()
    optimizer = tf.keras.optimizers.SGD(0.05 * hvd.size())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tape_losses = []
    for step in range(steps):
        batch = slice(16 * step % len(x), 16 * step % len(x) + 16)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[batch], tape_model(x[batch], training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, tape_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, tape_model.trainable_variables))
        if step == 0:  # as Horovod's examples: after the first step, once the optimizer has its variables
            hvd_tf.broadcast_variables(tape_model.variables, root_rank=0)
            hvd_tf.broadcast_variables(optimizer.variables, root_rank=0)
        tape_losses.append(float(hvd_tf.allreduce(loss, name="tape_loss_%d" % step)))

    return hvd_tf.allgather_object({
        "rank": hvd.rank(),
        "size": hvd.size(),
        "controller": "mpi" if os.environ.get("HOROVOD_CONTROLLER") == "mpi" else "gloo",
        "tf_use_legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
        "keras_module": type(keras_model).__module__,
        "keras_weights": [w.tolist() for w in keras_model.get_weights()],
        "keras_accuracy": [float(a) for a in history.history["accuracy"]],  # averaged over ranks
        "tape_weights": [v.numpy().tolist() for v in tape_model.variables],
        "tape_losses": tape_losses,
    })


def keras3_job() -> None:
    """What a user gets from a notebook written for Keras 3: ``import keras`` with Horovod's Keras API."""
    import horovod.tensorflow.keras as hvd
    import keras  # Keras 3, whatever TF_USE_LEGACY_KERAS says

    hvd.init()
    model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(2)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    print("wrapped a Keras 3 optimizer", flush=True)  # the runner must have refused it before this line
    model.compile(optimizer=optimizer, loss="mse")
    model.fit([[0.0, 1.0, 2.0, 3.0]], [[1.0, 0.0]], epochs=1, verbose=0)
