"""Gradient compression: `hvd.Compression.none`, `.fp16` and `.bf16` (a ringvod addition), for
torch tensors (the interface and rules: `frameworks._compression`). `DistributedOptimizer` and
the differentiable `allreduce`/`grouped_allreduce`/`reducescatter` take one; `check_compressor`
validates it when it is handed over, not in the middle of a backward pass.
"""
from __future__ import annotations

import torch

from .._compression import CastCompressor, Compressor, NoneCompressor, check_compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "check_compressor"]


class _TorchCast(CastCompressor):
    @staticmethod
    def floating(dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor.to(dtype)


class FP16Compressor(_TorchCast):
    """Casts floating tensors to float16 for the collective."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Casts floating tensors to bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors by name, as Horovod: `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
