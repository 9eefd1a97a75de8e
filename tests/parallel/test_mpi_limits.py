"""Results that must not depend on the MPI library: wrapping 8/16-bit integer sums (Open MPI
5's vectorised `op/avx` saturates them), NaN propagation under Max/Min whichever rank holds
the NaN, and MPI calls whose counts would exceed 2**31 - 1 (chunked; a real broadcast of more
than 2 GiB, and every chunked path with a lowered chunk size).

Run under a plain `mpirun` (the harness's), which does not exclude `op/avx`: the engine must be
right on its own.
"""
from __future__ import annotations

import numpy as np
import pytest

import collective as hvd
from tests._spmd import spmd_driver

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(120)]

test_spmd = spmd_driver(__file__, nps=(2,), timeout=150)


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def _all_ranks(fn) -> list[np.ndarray]:
    return [fn(r) for r in range(hvd.size())]


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.uint16])
@pytest.mark.parametrize("op", ["sum", "product"])
def test_small_integer_sums_and_products_wrap(dt, op) -> None:
    info = np.iinfo(dt)

    def mine(r: int) -> np.ndarray:  # near the type's edge, so that any reduction overflows
        base = info.min + 51 + r if info.min < 0 else info.max - 23 - r
        if op == "product":
            base = 99 + r
        return (np.arange(1000, dtype=np.int64) % 7 + base).astype(dt)

    ranks = _all_ranks(mine)
    expect = ranks[0].copy()
    for other in ranks[1:]:
        expect = (expect + other) if op == "sum" else (expect * other)  # NumPy wraps
    got = hvd.allreduce(mine(hvd.rank()), op=hvd.Sum if op == "sum" else hvd.Product,
                        name=f"wrap.{op}.{np.dtype(dt).name}")
    assert got.dtype == dt
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_propagates_under_max_and_min_from_any_rank(dt, op) -> None:
    for holder in range(hvd.size()):
        x = np.full(200, 1.0 + hvd.rank(), dt)
        if hvd.rank() == holder:
            x[7] = np.nan
        got = hvd.allreduce(x, op=hvd.Max if op == "max" else hvd.Min,
                            name=f"nan.{op}.{np.dtype(dt).name}.{holder}")
        assert np.isnan(got[7]), (holder, got[7])
        expect = float(hvd.size()) if op == "max" else 1.0
        assert (np.delete(got, 7) == expect).all(), (holder, got[:4])


def test_chunked_paths_with_a_lowered_chunk_size(monkeypatch) -> None:
    if hvd.mode() != "mpi":
        pytest.skip("MPI mode's chunking")
    from collective.engines import mpi
    monkeypatch.setattr(mpi, "MAX_CHUNK_BYTES", 1000)
    r, n = hvd.rank(), hvd.size()
    b = np.arange(10_001, dtype=np.uint8) + r  # odd size: the last chunk is partial
    np.testing.assert_array_equal(hvd.broadcast(b, 1 % n, name="chunk.bcast"),
                                  np.arange(10_001, dtype=np.uint8) + 1 % n)
    a = np.arange(5000, dtype=np.float64) * (r + 1)
    np.testing.assert_array_equal(hvd.allreduce(a, op=hvd.Sum, name="chunk.sum"),
                                  np.arange(5000) * (n * (n + 1) / 2))
    g = hvd.allgather(np.full((300 * (r + 1), 3), r, np.int32), name="chunk.gather")
    np.testing.assert_array_equal(
        g, np.concatenate([np.full((300 * (q + 1), 3), q, np.int32) for q in range(n)]))
    t = np.repeat(np.arange(n, dtype=np.int64) + 100 * r, 400)
    out = hvd.alltoall(t, splits=[400] * n, name="chunk.a2a")
    out = out[0] if isinstance(out, tuple) else out
    np.testing.assert_array_equal(out, np.repeat(np.arange(n) * 100 + r, 400))
    # Only rank 0's counts exceed a chunk (what it keeps for itself), and the two ends of a
    # pair need different numbers of chunks: every rank must still take the same path (rank
    # 0 exchanged pairwise while the others waited in one collective call: a hang).
    keep = 3000 if r == 0 else 10
    splits = [keep if q == r else 10 + q for q in range(n)]
    t = np.concatenate([np.full(c, 10 * r + q, np.uint8) for q, c in enumerate(splits)])
    out, got = hvd.alltoall(t, splits=splits, name="chunk.a2a.uneven")
    want = [(3000 if q == 0 else 10) if q == r else 10 + r for q in range(n)]
    assert list(got) == want, got
    np.testing.assert_array_equal(
        out, np.concatenate([np.full(c, 10 * q + r, np.uint8) for q, c in enumerate(want)]))
    rs = hvd.reducescatter(np.ones((n * 500, 2), np.float32), op=hvd.Sum, name="chunk.rs")
    np.testing.assert_array_equal(rs, np.full((500, 2), n, np.float32))
    s8 = hvd.allreduce(np.full(3000, -77 if r == 0 else -74, np.int8), op=hvd.Sum,
                       name="chunk.int8")
    if n == 2:
        assert (s8 == 105).all(), s8[:4]


@pytest.mark.slow
def test_broadcast_over_2_gib() -> None:
    """One real broadcast of more than 2**31 bytes (in place: about 2 GiB per rank)."""
    if hvd.mode() != "mpi" or hvd.size() < 2:
        pytest.skip("MPI mode at np >= 2")
    nbytes = (1 << 31) + 4099
    marks = {0: 7, (1 << 31) - 1: 8, 1 << 31: 9, nbytes - 1: 10}
    # zero pages on the root (nothing to touch), markers around the 2**31 boundary and the end
    buf = np.zeros(nbytes, np.uint8) if hvd.rank() == 0 else np.empty(nbytes, np.uint8)
    for i, v in marks.items():
        buf[i] = v if hvd.rank() == 0 else 1
    if hvd.rank() != 0:
        buf[(1 << 31) + 1:(1 << 31) + 4096] = 1
    hvd.broadcast_(buf, 0, name="big.bcast")
    for i, v in marks.items():
        assert buf[i] == v, (i, buf[i])
    assert not buf[(1 << 31) + 1:(1 << 31) + 4096].any()
    del buf
