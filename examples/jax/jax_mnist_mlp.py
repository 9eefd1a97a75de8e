"""A small MLP trained with JAX and optax on MNIST-shaped synthetic data, data-parallel with
`horovod.jax`.

    hvdrun -np 2 python examples/jax/jax_mnist_mlp.py
    hvdrun --mpi -np 2 python examples/jax/jax_mnist_mlp.py --steps 300

The Horovod pattern in JAX: every rank starts from rank 0's parameters
(`hvd.broadcast_variables`), computes gradients on its own shard in a jitted function, and the
optax optimizer wrapped in `hvd.DistributedOptimizer` averages them across ranks (one grouped
allreduce per step) before its update; the learning rate is scaled by the number of ranks and
only rank 0 prints. MNIST is replaced by noisy copies of ten fixed class prototypes (no
download needed).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import horovod.jax as hvd


def synthetic_mnist(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    protos = np.random.default_rng(0).random((10, 784)) > 0.5
    g = np.random.default_rng(seed)
    labels = g.integers(0, 10, n)
    images = protos[labels] * 0.8 + g.random((n, 784)) * 0.4
    return images.astype(np.float32), labels.astype(np.int32)


def init_params(key: jax.Array, sizes: tuple[int, ...] = (784, 64, 10)) -> list[dict]:
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * np.sqrt(2.0 / n_in),
                       "b": jnp.zeros(n_out)})
    return params


def logits_of(params: list[dict], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x), y).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001, help="per rank (scaled by size)")
    args = parser.parse_args()

    hvd.init()
    images, labels = synthetic_mnist(2048, seed=hvd.rank())  # each rank: its own shard

    # Horovod: start every rank from rank 0's parameters (each rank drew its own here).
    params = hvd.broadcast_variables(init_params(jax.random.PRNGKey(hvd.rank())), root_rank=0)
    # Horovod: scale the learning rate by the number of ranks; average gradients in update().
    tx = hvd.DistributedOptimizer(optax.adam(args.lr * hvd.size()))
    opt_state = tx.init(params)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))  # the collectives run outside jit
    apply = jax.jit(optax.apply_updates)
    rng = np.random.default_rng(hvd.rank())
    for step in range(args.steps):
        idx = rng.integers(0, len(images), args.batch_size)
        loss, grads = grad_fn(params, images[idx], labels[idx])
        updates, opt_state = tx.update(grads, opt_state, params)
        params = apply(params, updates)
        if step % 20 == 0:
            loss = hvd.allreduce(loss, name="loss")  # the average over ranks
            if hvd.rank() == 0:
                print(f"step {step}: loss {float(loss):.4f}", flush=True)

    test_x, test_y = synthetic_mnist(1000, seed=1000 + hvd.rank())
    correct = jnp.sum(jnp.argmax(logits_of(params, test_x), -1) == test_y)
    correct = hvd.allreduce(correct, op=hvd.Sum, name="correct")
    if hvd.rank() == 0:
        print(f"Final accuracy over {hvd.size()} ranks: "
              f"{100.0 * float(correct) / (1000 * hvd.size()):.2f}%", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
