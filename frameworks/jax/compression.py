"""Gradient compression for JAX arrays: `hvd.Compression.none`, `.fp16` and `.bf16` (the
interface and rules: `frameworks._compression`). The allreduce and reducescatter functions,
`allreduce_gradients` and `DistributedOptimizer` take one.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._compression import CastCompressor, Compressor, NoneCompressor, check_compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "check_compressor"]


class _JaxCast(CastCompressor):
    @staticmethod
    def floating(dtype: Any) -> bool:
        return bool(jnp.issubdtype(dtype, jnp.floating))

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return jnp.asarray(tensor).astype(dtype)


class FP16Compressor(_JaxCast):
    """Casts floating arrays to float16 for the collective."""

    wire_dtype = jnp.dtype(jnp.float16)


class BF16Compressor(_JaxCast):
    """Casts floating arrays to bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = jnp.dtype(jnp.bfloat16)


class Compression:
    """The compressors by name, as Horovod: `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
