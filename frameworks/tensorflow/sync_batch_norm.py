"""`SyncBatchNormalization`: Keras batch normalization with statistics over every rank's batch.

In training, each rank computes the per-channel sum and sum of squares of its batch and the
batch's element count; one grouped Sum allreduce (differentiable) gives the global mean and
variance. Inference uses the moving statistics, as Keras does.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import collective

from .mpi_ops import grouped_allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training statistics span all ranks.

    `fused` is accepted for Horovod compatibility (Keras 3 has no fused kernel choice); masks
    are not supported.
    """

    def __init__(self, fused: bool = False, **kwargs: Any) -> None:
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None:
            raise ValueError("SyncBatchNormalization does not support masks")
        if collective.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        local_sum = tf.reduce_sum(x, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x), axis=axes)
        total_sum, total_sq, total_count = grouped_allreduce(
            [local_sum, local_sq, tf.reshape(count, [1])], op=collective.Sum,
            name="sync_batch_norm", ignore_name_scope=True)
        mean = total_sum / total_count
        variance = tf.maximum(total_sq / total_count - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
