"""TF2 MNIST-style custom training loop with `DistributedGradientTape`, on synthetic data.

    hvdrun -np 2 python examples/tensorflow/tensorflow2_mnist.py
    hvdrun --mpi -np 2 python examples/tensorflow/tensorflow2_mnist.py --steps 200

The pattern of Horovod's `tensorflow2_mnist.py` (and the ANL tutorial's TF2 example): a
`tf.function` training step whose tape is wrapped in `hvd.DistributedGradientTape`, a learning
rate scaled by the number of ranks, model and optimizer variables broadcast from rank 0 after the
first step, and output on rank 0 only. MNIST is replaced by noisy copies of ten fixed class
prototypes (no download needed).
"""
from __future__ import annotations

import argparse

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
    parser.add_argument("--steps", type=int, default=100, help="training steps in total")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    hvd.init()

    images, labels = synthetic_mnist(2048, seed=hvd.rank())
    dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
               .repeat().shuffle(2048, seed=hvd.rank()).batch(args.batch_size))

    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    loss_fn = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Horovod: adjust the learning rate based on the number of workers.
    opt = tf.optimizers.Adam(0.001 * hvd.size())
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def training_step(x: tf.Tensor, y: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast initial variable states from rank 0 to all other processes. This
        # is done after the first gradient step so that the optimizer's variables exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        accuracy.update_state(y, logits)
        return loss

    # Horovod: adjust the number of steps based on the number of workers.
    for batch, (x, y) in enumerate(dataset.take(args.steps // hvd.size())):
        loss = training_step(x, y, batch == 0)
        if batch % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss):.6f}")

    acc = hvd.allreduce(tf.constant(float(accuracy.result())), name="final_accuracy")
    if hvd.rank() == 0:
        print(f"Final accuracy (averaged over {hvd.size()} ranks): {100 * float(acc):.1f}%")


if __name__ == "__main__":
    main()
