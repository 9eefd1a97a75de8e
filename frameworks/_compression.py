"""Gradient compression shared by the adapters: the compressor interface, the pass-through and
the cast-down compressors, and the check of a user's compressor. Each framework's
`compression` module binds the cast to its own tensor type and dtypes.

A compressor is a class with two static methods, `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`. Floating tensors are cast down before the collective and
back to their own dtype afterwards; other tensors pass through. As in Horovod, a cast-down
compressor's ctx is the input's dtype for every tensor.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Compressor", "NoneCompressor", "CastCompressor", "check_compressor"]


class Compressor:
    """Interface: compress before the collective, decompress after it."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Returns the tensor to send and the context `decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Restores a received tensor using `compress`'s context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor(Compressor):
    """Casts floating tensors to `wire_dtype`; a framework's subclass gives `floating(dtype)`
    and `cast(tensor, dtype)`."""

    wire_dtype: Any = None

    @staticmethod
    def floating(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        # As Horovod, ctx is always the input's dtype (float16 already, or not floating too).
        dtype = tensor.dtype
        if cls.floating(dtype) and dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        if ctx is not None and cls.floating(ctx) and tensor.dtype != ctx:
            return cls.cast(tensor, ctx)
        return tensor


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
