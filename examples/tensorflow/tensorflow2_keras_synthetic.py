"""Keras training with `horovod.tensorflow` (Horovod's README example), on synthetic data.

    hvdrun -np 2 python examples/tensorflow/tensorflow2_keras_synthetic.py
    hvdrun --mpi -np 2 python examples/tensorflow/tensorflow2_keras_synthetic.py --epochs 3

The Horovod pattern as written: `hvd.init()`, a learning rate scaled by the number of ranks,
`hvd.DistributedOptimizer`, `BroadcastGlobalVariablesCallback(0)` and `MetricAverageCallback()`
through `hvd.callbacks`, and checkpoints saved on rank 0 only. The images are noisy copies of ten
fixed class prototypes, so the accuracy climbs quickly when training works.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd


def synthetic_mnist(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    protos = np.random.default_rng(0).random((10, 28, 28, 1)) > 0.5
    g = np.random.default_rng(seed)
    labels = g.integers(0, 10, n)
    images = protos[labels] * 0.8 + g.random((n, 28, 28, 1)) * 0.4
    return images.astype(np.float32), labels.astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    hvd.init()

    # Each rank reads its own shard of the data.
    images, labels = synthetic_mnist(args.batch_size * args.steps_per_epoch, seed=hvd.rank())
    dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
               .repeat().shuffle(1000, seed=hvd.rank()).batch(args.batch_size))

    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    # Horovod: scale the learning rate by the number of workers.
    opt = tf.keras.optimizers.Adam(0.001 * hvd.size())
    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
    ]
    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    ckpt_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="tf2_keras_")
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(ckpt_dir, "checkpoint-{epoch}.keras")))

    history = model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
                        callbacks=callbacks, epochs=args.epochs,
                        verbose=1 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        acc = history.history["accuracy"][-1]
        print(f"Final accuracy (averaged over {hvd.size()} ranks): {100 * acc:.1f}%")
        print("Checkpoints:", ", ".join(sorted(os.listdir(ckpt_dir))))


if __name__ == "__main__":
    main()
