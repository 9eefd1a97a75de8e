"""Rank-side helpers for the torch SPMD tests: one world with static process sets, per-rank data,
and cross-rank agreement checks. Valid at any world size.
"""
from __future__ import annotations

import torch

import horovod.torch as hvd
from tests.parallel._util import env_size

SIZE = env_size()
PS_EVEN = hvd.ProcessSet(list(range(0, SIZE, 2)))
PS_ODD = hvd.ProcessSet(list(range(1, SIZE, 2))) if SIZE > 1 else None

# Every dtype ringvod's torch adapter accepts.
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + [torch.bool]


def init_world() -> None:
    """Idempotent: the first test module of the session creates the world and process sets."""
    hvd.init(process_sets=[PS_EVEN] + ([PS_ODD] if PS_ODD is not None else []))


def dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rank_tensor(seed: int, r: int, shape: tuple[int, ...], dtype: torch.dtype,
                low: int = -3, high: int = 3) -> torch.Tensor:
    """Small integer-valued data for rank r (exact in every dtype, including bfloat16)."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo = 0 if dtype == torch.uint8 else low
    return torch.randint(lo, high + 1, shape, generator=g).to(dtype)


def all_equal(t: torch.Tensor, name: str) -> bool:
    """True when `t` is bit-identical on every rank."""
    flat = t.detach().contiguous().view(1, -1)
    if flat.dtype.is_floating_point:
        flat = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    everyone = hvd.allgather(flat, name=f"all_equal.{name}")
    return bool((everyone == everyone[0]).all())


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
