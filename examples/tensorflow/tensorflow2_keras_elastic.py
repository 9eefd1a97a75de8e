r"""Elastic Keras training with `horovod.tensorflow.keras` on synthetic data.

    hvdrun -np 2 --min-np 1 -H server1:1,server2:1 \
        python examples/tensorflow/tensorflow2_keras_elastic.py
    hvdrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh \
        python examples/tensorflow/tensorflow2_keras_elastic.py --epochs 10

Horovod's elastic Keras pattern: a `KerasState` holds the model, the optimizer and the epoch and
batch counters; the update callbacks keep the counters current and `CommitStateCallback` commits
every few batches and at each epoch's end. When a worker dies, the others restore the last
commit, re-form the ring and resume the interrupted epoch at `state.batch`; when a host joins,
it receives the state from rank 0. The learning rate follows the number of workers (reset
callback).
"""
from __future__ import annotations

import argparse

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    protos = np.random.default_rng(0).random((10, 28, 28, 1)) > 0.5
    g = np.random.default_rng(seed)
    labels = g.integers(0, 10, n)
    images = protos[labels] * 0.8 + g.random((n, 28, 28, 1)) * 0.4
    return images.astype(np.float32), labels.astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches-per-epoch", type=int, default=30)
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    hvd.init()
    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10),
    ])
    opt = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    model.compile(optimizer=hvd.DistributedOptimizer(opt),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_reset() -> None:  # the world changed size: follow it with the learning rate
        model.optimizer.learning_rate.assign(args.lr * hvd.size())
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} worker(s), resuming at epoch {state.epoch} batch "
                  f"{state.batch}", flush=True)

    state.register_reset_callbacks([on_reset])
    callbacks = [
        hvd.callbacks.MetricAverageCallback(),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        while state.epoch < args.epochs:
            # Each epoch's data depends on (epoch, rank, size); after a reset mid-epoch, the
            # batches already committed are skipped.
            n = args.batches_per_epoch * args.batch_size
            x, y = synthetic(n, seed=1000 * state.epoch + 10 * hvd.rank() + hvd.size())
            start = state.batch * args.batch_size
            history = model.fit(x[start:], y[start:], batch_size=args.batch_size, epochs=1,
                                shuffle=False, callbacks=callbacks, verbose=0)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}/{args.epochs} on {hvd.size()} worker(s): loss "
                      f"{history.history['loss'][-1]:.4f} accuracy "
                      f"{100 * history.history['accuracy'][-1]:.1f}%", flush=True)

    train(state)
    if hvd.rank() == 0:
        print(f"Final accuracy after {state.epoch} epochs: "
              f"{100 * model.evaluate(*synthetic(512, 7), verbose=0)[1]:.1f}%", flush=True)


if __name__ == "__main__":
    main()
