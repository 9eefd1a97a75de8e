"""Gradient compression for TensorFlow: `hvd.Compression.none`, `.fp16` and `.bf16` (a ringvod
addition).

A compressor has two static methods, `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`. Floating tensors are cast down before the collective and
back to their own dtype afterwards; other tensors pass through.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "check_compressor"]


class Compressor:
    """Interface: compress before the collective, decompress after it."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor to send and the context `decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Restores a received tensor using `compress`'s context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        if ctx is not None and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Casts floating tensors to float16 for the collective."""

    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Casts floating tensors to bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The compressors by name, as Horovod: `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def check_compressor(compression: Any) -> Any:
    """Returns `compression` if it has callable `compress` and `decompress`.

    Raises:
        TypeError: it does not.
    """
    for attr in ("compress", "decompress"):
        if not callable(getattr(compression, attr, None)):
            raise TypeError(f"compression={compression!r} has no callable {attr}(); pass "
                            "hvd.Compression.none, .fp16, .bf16 or a class with static "
                            "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)")
    return compression
