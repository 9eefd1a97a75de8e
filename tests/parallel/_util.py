"""Rank-side helpers for SPMD tests: world size before init, per-rank data, agreement.

Every helper is deterministic across ranks: data for rank r is a function of (seed, r), so each
rank can also compute every other rank's input and hence the numpy reference.
"""
from __future__ import annotations

import os
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np

import collective as hvd

INT_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64]
FLOAT_DTYPES = [np.float16, np.float32, np.float64]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + [np.bool_]


def env_size() -> int:
    """World size from the launcher's environment (for arguments needed before `init`)."""
    for v in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "WORLD_SIZE"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 1


def rank_data(seed: int, r: int, shape: tuple[int, ...], dtype: np.dtype,
              low: int = -3, high: int = 3) -> np.ndarray:
    """Small integer-valued data (exact in every dtype, no overflow in products of 4)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng([seed, r])
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    lo = 0 if dt.kind == "u" else low
    return rng.integers(lo, high + 1, size=shape).astype(dt)


def reference_reduce(parts: list[np.ndarray], op: int, pre: float = 1.0, post: float = 1.0,
                     size: int | None = None) -> np.ndarray:
    """What a ringvod allreduce of `parts` must give (Horovod's CPU semantics)."""
    dt = parts[0].dtype
    n = len(parts) if size is None else size
    if op == hvd.Average:
        op, post = hvd.Sum, post / n
    if dt == np.bool_:
        stack = np.stack(parts)
        return stack.all(0) if op in (hvd.Min, hvd.Product) else stack.any(0)
    if dt.kind in "iu":
        work = [np.trunc(p.astype(np.float64) * pre).astype(dt) if pre != 1.0 else p
                for p in parts]
        acc = _fold(work, op).astype(dt)
        if post != 1.0:
            acc = np.trunc(acc.astype(np.float64) * post).astype(dt)
        return acc
    work = [p.astype(np.float64) * pre for p in parts]
    return (_fold(work, op) * post).astype(dt)


def _fold(parts: list[np.ndarray], op: int) -> np.ndarray:
    fn = {hvd.Sum: np.add, hvd.Min: np.minimum, hvd.Max: np.maximum,
          hvd.Product: np.multiply}[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = fn(acc, p)
    return acc


def assert_close(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype.kind == "f":
        rtol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[want.dtype.itemsize]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                                   atol=rtol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def agree(body: Callable[[], None], label: str = "") -> None:
    """Runs `body` on every rank, then fails on every rank if it failed on any rank.

    Keeps hypothesis in lockstep: all ranks see the same pass/fail for each example, so they
    move to the same next example. Uses one fixed name, so it stays on the cache fast path.
    """
    err = ""
    try:
        body()
    except Exception:  # noqa: BLE001 - reported to every rank below
        err = traceback.format_exc()
    failed = hvd.allreduce(np.array([1 if err else 0], dtype=np.int32), op=hvd.Max,
                           name="spmd.agree")
    if err:
        raise AssertionError(f"rank {hvd.rank()} failed {label}:\n{err}")
    if failed[0]:
        raise AssertionError(f"another rank failed {label} (see its log); rank {hvd.rank()} "
                             "passed")


@contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Asserts that the block finishes within `seconds` (time.monotonic)."""
    t0 = time.monotonic()
    yield
    dt = time.monotonic() - t0
    assert dt < seconds, f"{what} took {dt:.2f} s (limit {seconds} s)"
