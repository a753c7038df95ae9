"""Train a Keras model on scikit-learn's digits with Horovod on Spark, then check its accuracy.

The training function follows Horovod's Keras migration steps, unchanged from a notebook:

1. ``hvd.init()``;
2. shard the data by rank;
3. scale the learning rate by ``hvd.size()``;
4. wrap the optimizer in ``hvd.DistributedOptimizer``;
5. ``BroadcastGlobalVariablesCallback(0)``: every rank starts from rank 0's weights;
6. ``MetricAverageCallback``: the epoch's metrics are the mean over ranks;
7. checkpoint on rank 0 only, each epoch, into ``runtime.checkpoint_dir()``;
8. resume with ``hvd.load_model`` when ``runtime.resume_dir()`` holds a checkpoint (a retry; a
   clear in the UI starts from scratch unless the task says ``resume_on_clear=True``): the model, its
   optimizer state and the epoch come back.

It needs the ``tensorflow`` extra (``pip install airflow-provider-horovod[tensorflow]``: TensorFlow
and tf-keras, and a Horovod built with TensorFlow). ``tf.keras`` here is Keras 2 from tf-keras: the
runner sets ``TF_USE_LEGACY_KERAS=1`` for every rank. Keras 3 (``import keras``) is refused with an
error, because Horovod trains it silently wrong (see docs/how-to.md).

To watch a recovery, trigger the DAG with ``{"fail_first_try_after_epoch": 3}``: the ranks are
killed once the epoch-3 checkpoint is saved, as a lost machine's would be. The runner starts the
barrier stage again inside the same try (``max_restarts``, 2 by default), from the newest checkpoint
version the driver committed, and trains on to ``epochs``: the task succeeds in its first try, with
two attempts (the ``horovod_attempts`` XCom, the task log). Were the restarts used up,
``HorovodRetryPolicy`` would retry the task after 5 s (an exception of the training function it
would not retry: the next try would raise it again), and that retry would resume the same way.

``evaluate`` gets ``train``'s return value and the checkpoint's URI (the ``horovod_checkpoint_uri``
XCom of the same task), loads the checkpoint with tf-keras and fails below 90 % held-out accuracy.
Nothing here imports TensorFlow, Spark or Horovod when the file is parsed.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pendulum

from airflow.sdk import dag, task

from airflow_provider_horovod.retry import HorovodRetryPolicy

CHECKPOINT_FILE = "model.h5"
MIN_ACCURACY = 0.90


def load_digits_split():
    """The digits data set (shipped with scikit-learn, nothing to download), split 75/25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    return train_test_split(features / 16.0, labels, test_size=0.25, random_state=0, stratify=labels)


def build_model():
    import tensorflow as tf

    return tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def train_keras_digits(epochs: int = 8, batch_size: int = 32, base_lr: float = 0.05,
                       fail_first_try_after_epoch: int = 0) -> dict:
    """Runs on every Horovod rank; trains up to ``epochs`` in all and returns rank 0's summary."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from airflow_provider_horovod import runtime

    tf.config.threading.set_intra_op_parallelism_threads(1)  # one rank per Spark task slot
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    tf.keras.utils.set_random_seed(hvd.rank())  # rank 0's initial weights are broadcast to all

    x_train, _, y_train, _ = load_digits_split()
    x, y = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]  # this rank's shard

    first_epoch = 0
    resume = runtime.resume_dir()  # set on a retry, or when resuming from a given checkpoint
    if resume is not None and (resume / CHECKPOINT_FILE).exists():
        # the model, and its optimizer wrapped in hvd.DistributedOptimizer again, with its state
        model = hvd.load_model(str(resume / CHECKPOINT_FILE))
        first_epoch = read_epoch(resume / CHECKPOINT_FILE)
        runtime.log_to_driver("rank %d resumes after epoch %d" % (hvd.rank(), first_epoch))
    else:
        model = build_model()
        optimizer = tf.keras.optimizers.SGD(learning_rate=base_lr * hvd.size(), momentum=0.9)
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    class Checkpoint(tf.keras.callbacks.Callback):
        """Rank 0 saves the model each epoch, under a temporary name, then renames it."""

        def on_epoch_end(self, epoch, logs=None):
            done = epoch + 1  # Keras counts epochs from 0
            if hvd.rank() == 0:
                save_checkpoint(self.model, done, runtime.checkpoint_dir())
                runtime.log_to_driver("epoch %d: loss %.4f, accuracy %.4f" % (done, logs["loss"], logs["accuracy"]))
            # every rank may call it: rank 0's values are the job's (task log, Horovod view, metrics.jsonl)
            runtime.report(step=done, total_steps=epochs, loss=float(logs["loss"]),
                           acc=float(logs["accuracy"]))
            if resume is None and done == fail_first_try_after_epoch:
                hvd.allreduce(tf.constant(0.0), name="checkpoint_saved")  # rank 0 has saved: all fail together
                print("fail_first_try_after_epoch=%d: this try's ranks are killed on purpose" % done, flush=True)
                time.sleep(1.0)  # the rank's output reaches the driver from a thread the kill would cut short
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost machine would

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),  # before Checkpoint: it logs the averaged metrics
        Checkpoint(),
    ]
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, initial_epoch=first_epoch,
                        callbacks=callbacks, verbose=0)
    return {
        "epochs": epochs,
        "resumed_after_epoch": first_epoch,
        "loss": round(float(history.history["loss"][-1]), 4) if history.history else None,
        "ranks": hvd.size(),
    }


def save_checkpoint(model, epoch: int, folder) -> None:
    """``model.h5`` with the epoch as an HDF5 attribute; never seen half-written."""
    import h5py

    tmp = folder / (".%s.tmp" % CHECKPOINT_FILE)
    model.save(str(tmp), save_format="h5")  # weights and optimizer state
    with h5py.File(tmp, "a") as f:
        f.attrs["epoch"] = epoch
    os.replace(tmp, folder / CHECKPOINT_FILE)


def read_epoch(path) -> int:
    import h5py

    with h5py.File(path, "r") as f:
        return int(f.attrs["epoch"])


def held_out_accuracy(checkpoint_uri: str) -> float:
    """Load ``model.h5`` from a stored checkpoint folder (any ObjectStoragePath URI) and score it."""
    import tempfile

    import numpy as np
    import tf_keras  # Keras 2 by its own name: this runs outside the ranks, with no TF_USE_LEGACY_KERAS

    from airflow.sdk import ObjectStoragePath

    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, CHECKPOINT_FILE)
        with (ObjectStoragePath(checkpoint_uri) / CHECKPOINT_FILE).open("rb") as stored, open(local, "wb") as out:
            out.write(stored.read())
        model = tf_keras.models.load_model(local, compile=False)
    _, x_test, _, y_test = load_digits_split()
    predicted = np.argmax(model.predict(x_test, verbose=0), axis=1)
    return float(np.mean(predicted == y_test))


@dag(
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    tags=["example", "horovod", "keras"],
    default_args={"retries": 1},
    params={"epochs": 8, "fail_first_try_after_epoch": 0},
)
def horovod_keras_digits():
    # a lost executor or rank is worth retrying soon: the retry resumes from the last checkpoint
    @task.horovod(np=2, retry_policy=HorovodRetryPolicy(lost_delay=datetime.timedelta(seconds=5)))
    def train(epochs: str, fail_first_try_after_epoch: str):
        return train_keras_digits(epochs=int(epochs), fail_first_try_after_epoch=int(fail_first_try_after_epoch))

    @task
    def evaluate(summary: dict, checkpoint_uri: str) -> dict:
        accuracy = held_out_accuracy(checkpoint_uri)
        print("Held-out accuracy %.4f after %s epochs; checkpoint %s" % (accuracy, summary["epochs"], checkpoint_uri))
        if accuracy < MIN_ACCURACY:
            raise ValueError("Held-out accuracy %.4f is below %.2f" % (accuracy, MIN_ACCURACY))
        return {"accuracy": accuracy, "checkpoint_uri": checkpoint_uri}

    trained = train(epochs="{{ params.epochs }}", fail_first_try_after_epoch="{{ params.fail_first_try_after_epoch }}")
    evaluate(trained, trained["horovod_checkpoint_uri"])  # the function's value and a metadata key of the task


horovod_keras_digits()
