"""Gradient compression: `hvd.Compression.none`, `.fp16` and `.bf16` (a ringvod addition).

A compressor is a class with two static methods, `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`. Floating tensors are cast down before the collective and
back to their own dtype afterwards; other tensors pass through. `DistributedOptimizer` and the
differentiable `allreduce`/`grouped_allreduce`/`reducescatter` take one; `check_compressor`
validates it when it is handed over, not in the middle of a backward pass.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "check_compressor"]


class Compressor:
    """Interface: compress before the collective, decompress after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor to send and the context `decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Restores a received tensor using `compress`'s context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Casts floating tensors to float16 for the collective."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Casts floating tensors to bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


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
