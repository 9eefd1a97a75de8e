"""`DistributedOptimizer`: wraps an optax `GradientTransformation` so that its `update` first
averages the gradients over the process set (`allreduce_gradients`: one grouped op for the whole
tree), then runs the wrapped transformation. optax is imported when an optimizer is built.
"""
from __future__ import annotations

from typing import Any

from collective import ProcessSet, ReduceOp, global_process_set

from .._common import gradient_reduction
from .compression import Compression, check_compressor
from .functions import allreduce_gradients

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: Any, op: ReduceOp = ReduceOp.AVERAGE,  # noqa: N802
                         gradient_predivide_factor: float = 1.0,
                         compression: Any = Compression.none, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> Any:
    """An optax transformation that allreduces the gradients, then applies `optimizer`.

    `init` is `optimizer.init`. `update(grads, state, params=None, **extra)` averages `grads`
    (a pytree) across the process set in one grouped allreduce, then returns
    `optimizer.update(averaged, state, params, **extra)`. Call `update` on concrete arrays,
    outside `jax.jit` (jit the gradient computation and, if you like, a step that applies
    the updates; docs/jax.md).

    Args:
        optimizer: an `optax.GradientTransformation` (with extra args or not).
        op: hvd.Average (default) or hvd.Sum, Min, Max, Product.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size/factor after it.
        compression: hvd.Compression.none, .fp16 or .bf16 (the wire dtype of floating grads).
        name: keys the grouped op across ranks (default "DistributedOptimizer.allreduce");
            give two optimizers stepped together different names.
        process_set: the ranks to average over.

    Raises:
        ModuleNotFoundError: optax is not installed.
        NotImplementedError: op=hvd.Adasum; ValueError: a predivide factor without Average.
    """
    try:
        import optax
    except ImportError as exc:
        raise ModuleNotFoundError("hvd.DistributedOptimizer wraps an optax optimizer; install "
                                  "optax (`pip install optax`, or \".[jax]\" in the ringvod "
                                  "clone)", name="optax") from exc
    op, _ = gradient_reduction(op, gradient_predivide_factor, 0, None)
    check_compressor(compression)
    if not callable(getattr(optimizer, "update", None)) or not callable(
            getattr(optimizer, "init", None)):
        raise TypeError(f"DistributedOptimizer wraps an optax GradientTransformation (with init "
                        f"and update); got {optimizer!r}")
    pre, post = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                 if op == ReduceOp.AVERAGE else (1.0, 1.0))
    key = name or "DistributedOptimizer.allreduce"

    def update(grads: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        reduced = allreduce_gradients(grads, op=op, compression=compression,
                                      prescale_factor=pre, postscale_factor=post, name=key,
                                      process_set=process_set)
        return optimizer.update(reduced, state, params, **extra)

    if isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return optax.GradientTransformationExtraArgs(optimizer.init, update)
    return optax.GradientTransformation(optimizer.init, update)
