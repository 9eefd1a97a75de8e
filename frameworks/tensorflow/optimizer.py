"""`horovod.tensorflow.DistributedOptimizer`: Keras 3 optimizers (the usual TF2 case) get the
Keras wrapper; TF1 `tf.compat.v1.train.Optimizer`s get one whose `compute_gradients` reduces.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from collective import ProcessSet, ReduceOp, global_process_set

from ._reduce import GradientReducer
from .compression import Compression

__all__ = ["DistributedOptimizer"]


class _DistributedV1Mixin:
    _hvd_reducer: GradientReducer

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient local (not reduced; scaled by 1/size when
        `scale_local_gradients`), as Horovod's TF1 optimizer does."""
        self._hvd_reducer.register_local_source(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        gvs = super().compute_gradients(*args, **kwargs)
        grads = self._hvd_reducer.reduce([g for g, _ in gvs], [v for _, v in gvs])
        return list(zip(grads, [v for _, v in gvs]))


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: ReduceOp = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wraps an optimizer so that gradients are reduced across the process set.

    Raises:
        ValueError: not an optimizer, or (TF1) `backward_passes_per_step` > 1.
    """
    import keras
    if isinstance(optimizer, keras.optimizers.Optimizer):
        from .keras.optimizer import DistributedOptimizer as keras_wrapper
        return keras_wrapper(optimizer, name, device_dense, device_sparse, compression,
                             sparse_as_dense, gradient_predivide_factor, op,
                             backward_passes_per_step, average_aggregated_gradients, num_groups,
                             groups, process_set, scale_local_gradients)
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError("DistributedOptimizer wraps a keras.optimizers.Optimizer or a "
                         f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
    if backward_passes_per_step != 1:
        raise ValueError("backward_passes_per_step > 1 is supported for Keras optimizers only")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedV1Mixin, base), {})
    new = cls.__new__(cls)
    new.__dict__.update(optimizer.__dict__)
    new._hvd_reducer = GradientReducer(
        name or f"Distributed{base.__name__}", compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
        device_dense, device_sparse)
    return new
