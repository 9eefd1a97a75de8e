"""Gradient compression for TensorFlow: `hvd.Compression.none`, `.fp16` and `.bf16` (a ringvod
addition), for TF tensors (the interface and rules: `frameworks._compression`).
"""
from __future__ import annotations

import tensorflow as tf

from .._compression import CastCompressor, Compressor, NoneCompressor, check_compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "check_compressor"]


class _TFCast(CastCompressor):
    @staticmethod
    def floating(dtype: tf.DType) -> bool:
        return dtype.is_floating

    @staticmethod
    def cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCast):
    """Casts floating tensors to float16 for the collective."""

    wire_dtype = tf.float16


class BF16Compressor(_TFCast):
    """Casts floating tensors to bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The compressors by name, as Horovod: `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
