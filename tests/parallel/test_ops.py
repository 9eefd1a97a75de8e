"""Every numpy-level collective under real ranks, checked against numpy; valid at any np.

Run by the driver at np 1, 2 and 4 (`pytest tests/parallel/test_ops.py`), or directly:
`mpirun --allow-run-as-root --oversubscribe -np 2 python -m pytest tests/parallel/test_ops.py`.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import collective as hvd
from tests._spmd import spmd_driver
from tests.parallel._util import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, assert_close, rank_data,
                                  reference_reduce)

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(120)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=150)


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def parts(seed, shape, dtype, size=None):
    n = hvd.size() if size is None else size
    return [rank_data(seed, r, shape, dtype) for r in range(n)]


def test_topology():
    assert 0 <= hvd.rank() < hvd.size()
    assert hvd.local_size() == hvd.size()  # one host
    assert hvd.local_rank() == hvd.rank()
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.is_initialized() and hvd.mpi_enabled() and hvd.mode() == "mpi"
    assert hvd.is_homogeneous()
    ranks = hvd.allgather(np.array([hvd.rank()], dtype=np.int64), name="topology")
    np.testing.assert_array_equal(ranks, np.arange(hvd.size()))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average],
                         ids=["sum", "min", "max", "prod", "avg"])
def test_allreduce_dtypes_ops(dtype, op):
    if np.dtype(dtype) == np.bool_ and op == hvd.Average:
        with pytest.raises(ValueError, match="Average of a bool tensor"):
            hvd.allreduce(np.ones(3, dtype=bool), op=op)
        return
    ps = parts(zlib.crc32(f"{np.dtype(dtype).name}{int(op)}".encode()), (3, 5), dtype)
    got = hvd.allreduce(ps[hvd.rank()], op=op, name=f"ar.{np.dtype(dtype).name}.{int(op)}")
    assert_close(got, reference_reduce(ps, op), f"allreduce {np.dtype(dtype).name} op {op}")


@pytest.mark.parametrize("dtype", INT_DTYPES + FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
def test_allreduce_scaling(dtype, op):
    ps = parts(7, (4,), dtype)
    got = hvd.allreduce(ps[hvd.rank()], op=op, prescale_factor=2.0, postscale_factor=0.5,
                        name=f"scale.{np.dtype(dtype).name}.{int(op)}")
    assert_close(got, reference_reduce(ps, op, 2.0, 0.5), "scaled allreduce")


def test_allreduce_default_op_is_average_and_input_untouched():
    x = np.full(4, float(hvd.rank()), dtype=np.float32)
    before = x.copy()
    got = hvd.allreduce(x, name="default_op")
    np.testing.assert_allclose(got, np.full(4, (hvd.size() - 1) / 2.0))
    np.testing.assert_array_equal(x, before)
    with pytest.warns(DeprecationWarning):
        got = hvd.allreduce(x, average=False, name="deprecated_average")
    np.testing.assert_allclose(got, np.full(4, sum(range(hvd.size()))))


def test_allreduce_inplace_and_scalar_and_empty():
    x = np.full((2, 3), hvd.rank() + 1, dtype=np.int64)
    out = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    assert out is x or np.shares_memory(out, x)
    np.testing.assert_array_equal(x, np.full((2, 3), hvd.size() * (hvd.size() + 1) // 2))
    s = hvd.allreduce(np.float64(hvd.rank()), op=hvd.Max, name="scalar")
    assert s.shape == () and float(s) == hvd.size() - 1
    e = hvd.allreduce(np.zeros((0, 3), dtype=np.float32), op=hvd.Sum, name="empty")
    assert e.shape == (0, 3)


def test_allreduce_noncontiguous_input_is_copied():
    base = np.arange(12, dtype=np.float64).reshape(3, 4) * (hvd.rank() + 1)
    got = hvd.allreduce(base[:, ::2], op=hvd.Sum, name="noncontig")
    factor = hvd.size() * (hvd.size() + 1) / 2
    np.testing.assert_allclose(got, np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2] * factor)
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(base[:, ::2], name="noncontig_inplace")


def test_inplace_op_on_a_read_only_array_is_a_local_error():
    # Once, the engine's write into the array raised on the coordinator and aborted the job.
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        hvd.allreduce_(ro, op=hvd.Sum, name="ro_inplace")
    with pytest.raises(ValueError, match="read-only"):
        hvd.allreduce_async_(ro, op=hvd.Sum, name="ro_inplace_async")
    with pytest.raises(ValueError, match="read-only"):
        hvd.grouped_allreduce_([np.ones(1), ro], op=hvd.Sum, name="ro_grouped")
    if hvd.rank() != 0:  # the root only sends: a read-only array is fine there
        with pytest.raises(ValueError, match="read-only"):
            hvd.broadcast_(ro, root_rank=0, name="ro_bcast")
    src = np.full(3, 7.0)
    src.flags.writeable = False
    out = hvd.broadcast_(src if hvd.rank() == 0 else np.zeros(3), root_rank=0, name="ro_root")
    np.testing.assert_allclose(out, np.full(3, 7.0))
    np.testing.assert_allclose(hvd.allreduce(ro, op=hvd.Sum, name="ro_out_of_place"),
                               np.full(3, hvd.size()))
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="ro_after"),
                               np.full(2, hvd.size()))


def test_many_async_allreduces_fuse_and_complete():
    n = 60
    xs = [np.full(257 + i, i + hvd.rank(), dtype=np.float32) for i in range(n)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"many.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        got = hvd.synchronize(h)
        np.testing.assert_allclose(got, np.full(257 + i, i * hvd.size() + sum(range(hvd.size()))))
        assert hvd.poll(h)
    # Mixed dtypes interleaved (the look-ahead path of fusion planning).
    hs = [hvd.allreduce_async(np.ones(10, dtype=np.float16 if i % 2 else np.float32),
                              op=hvd.Sum, name=f"mixed.{i}") for i in range(20)]
    for i, h in enumerate(hs):
        got = h.wait(30)
        assert got.dtype == (np.float16 if i % 2 else np.float32)
        np.testing.assert_array_equal(got, np.full(10, hvd.size()))


def test_unnamed_ops_match_in_issue_order():
    hs = [hvd.allreduce_async(np.full(3, i, dtype=np.int32), op=hvd.Sum) for i in range(5)]
    for i, h in enumerate(hs):
        np.testing.assert_array_equal(hvd.synchronize(h), np.full(3, i * hvd.size()))
        assert h.name.startswith("allreduce.noname.")


def test_repeated_name_uses_cache_and_stays_correct():
    for step in range(30):
        x = np.full(5, step + hvd.rank(), dtype=np.float64)
        got = hvd.allreduce(x, op=hvd.Sum, name="cached")
        np.testing.assert_allclose(got, np.full(5, step * hvd.size() + sum(range(hvd.size()))))
    # Same name with a different shape: the cache entry is invalid, renegotiated everywhere.
    got = hvd.allreduce(np.ones(7), op=hvd.Sum, name="cached")
    np.testing.assert_allclose(got, np.full(7, hvd.size()))


@pytest.mark.parametrize("inplace", [False, True])
def test_grouped_allreduce(inplace):
    ts = [np.full(s, hvd.rank() + 1.0) for s in (1, 10, 100)]
    fn = hvd.grouped_allreduce_ if inplace else hvd.grouped_allreduce
    outs = fn(ts, op=hvd.Sum, name=f"group{inplace}")
    assert isinstance(outs, list) and len(outs) == 3
    for t, o in zip(ts, outs):
        np.testing.assert_allclose(o, np.full(t.shape, hvd.size() * (hvd.size() + 1) / 2))
        if inplace:
            assert np.shares_memory(o, t)
    h = hvd.grouped_allreduce_async([np.ones(2)], op=hvd.Sum, name="g1")
    assert h.name == "grouped_allreduce.g1"
    np.testing.assert_allclose(h.wait(30)[0], np.full(2, hvd.size()))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_variable_dim0(dtype):
    ps = [rank_data(3, r, (r + 1, 2, 3), dtype) for r in range(hvd.size())]
    got = hvd.allgather(ps[hvd.rank()], name=f"ag.{np.dtype(dtype).name}")
    assert_close(got, np.concatenate(ps), "allgather")


def test_allgather_zero_rows_and_grouped():
    ps = [np.arange(r * 4, dtype=np.float32).reshape(r, 4) for r in range(hvd.size())]
    got = hvd.allgather(ps[hvd.rank()], name="ag.zero")
    np.testing.assert_array_equal(got, np.concatenate(ps))
    a = [np.full((r + 1,), r, dtype=np.int32) for r in range(hvd.size())]
    b = [np.full((2, 2), r, dtype=np.float64) for r in range(hvd.size())]
    out = hvd.grouped_allgather([a[hvd.rank()], b[hvd.rank()]], name="ag.group")
    np.testing.assert_array_equal(out[0], np.concatenate(a))
    np.testing.assert_array_equal(out[1], np.concatenate(b))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_every_root(dtype):
    for root in range(hvd.size()):
        x = rank_data(root, hvd.rank(), (3, 2), dtype)
        want = rank_data(root, root, (3, 2), dtype)
        got = hvd.broadcast(x, root_rank=root, name=f"bc.{np.dtype(dtype).name}.{root}")
        assert_close(got, want, f"broadcast from {root}")
        y = x.copy()
        out = hvd.broadcast_(y, root_rank=root, name=f"bc_.{np.dtype(dtype).name}.{root}")
        assert_close(y, want, "in-place broadcast")
        assert np.shares_memory(out, y)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16],
                         ids=lambda d: np.dtype(d).name)
def test_alltoall_even_and_splits(dtype):
    n, me = hvd.size(), hvd.rank()

    def block(src):  # the 2 rows that rank `src` sends to each rank, values depend on src/dst
        return (np.arange(n * 2 * 3).reshape(n * 2, 3) + 7 * src).astype(dtype)

    out = hvd.alltoall(block(me), name=f"a2a.even.{np.dtype(dtype).name}")
    want = np.concatenate([block(src)[2 * me:2 * me + 2] for src in range(n)])
    assert_close(out, want, "even alltoall")
    # rank r sends (r + d) % 3 rows to rank d, each row filled with 100 * r + d.
    splits = np.array([(me + d) % 3 for d in range(n)], dtype=np.int32)
    rows = np.concatenate([np.full(((me + d) % 3, 2), 100 * me + d) for d in range(n)]
                          ).astype(np.int64).reshape(-1, 2)
    out, recv = hvd.alltoall(rows, splits=splits, name=f"a2a.splits.{np.dtype(dtype).name}")
    np.testing.assert_array_equal(recv, [(s + me) % 3 for s in range(n)])
    assert recv.dtype == np.int32
    want = np.concatenate([np.full(((s + me) % 3, 2), 100 * s + me) for s in range(n)]
                          ).astype(np.int64).reshape(-1, 2)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16],
                         ids=lambda d: np.dtype(d).name)
def test_reducescatter_uneven(op, dtype):
    n, me = hvd.size(), hvd.rank()
    dim0 = 2 * n + 1  # the first dim0 % n ranks get one more row
    ps = parts(11, (dim0, 3), dtype)
    got = hvd.reducescatter(ps[me], op=op, name=f"rs.{np.dtype(dtype).name}.{int(op)}")
    full = reference_reduce(ps, op)
    counts = [dim0 // n + (1 if r < dim0 % n else 0) for r in range(n)]
    start = sum(counts[:me])
    assert_close(got, full[start:start + counts[me]], "reducescatter")


def test_grouped_reducescatter_and_op_check():
    n, me = hvd.size(), hvd.rank()
    a = parts(1, (n * 2,), np.float32)
    b = parts(2, (n, 2), np.float32)
    out = hvd.grouped_reducescatter([a[me], b[me]], op=hvd.Sum, name="grs")
    np.testing.assert_allclose(out[0], reference_reduce(a, hvd.Sum)[2 * me:2 * me + 2])
    np.testing.assert_allclose(out[1], reference_reduce(b, hvd.Sum)[me:me + 1])
    with pytest.raises(RuntimeError, match="Reducescatter currently only supports AVERAGE and "
                                           "SUM."):
        hvd.reducescatter(a[me], op=hvd.Max, name="rs.max")


def test_barrier_and_poll_and_handle_wait():
    for _ in range(3):
        hvd.barrier()
    h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="pollme")
    np.testing.assert_allclose(h.wait(30), np.full(3, hvd.size()))
    assert hvd.poll(h) and h.done() and h.exception() is None


def test_named_synchronous_ops_take_the_express_lane():
    # A lone synchronous op whose name is cached runs inside its own enqueue on the caller's
    # thread (Coordinator.express); an idle round of a peer's coordinator thread can make an
    # op take the ordinary path now and then, never most of the time.
    from collective._current import current

    coord = current().coordinator
    n = hvd.size()
    hvd.allreduce(np.ones(3), op=hvd.Sum, name="express")  # negotiated once, then cached
    before = coord.express_rounds
    for i in range(20):
        x = np.full(3, float(hvd.rank() + i))
        out = hvd.allreduce_(x, op=hvd.Sum, name="express")
        np.testing.assert_allclose(out, np.full(3, float(sum(range(n)) + n * i)))
        np.testing.assert_allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="express"),
                                   np.full(3, float(n)))
    assert coord.express_rounds - before >= 20, coord.express_rounds - before


@pytest.mark.parametrize("count", [16, 1 << 18], ids=["small", "ring"])
def test_sum_past_float_range_is_inf_and_nan_without_warnings(count):
    """A sum that overflows is inf (and inf + -inf nan) on every rank, as MPI and NCCL give
    it, with no numpy RuntimeWarning from inside the engine (the tcp engine reduces in numpy)."""
    import warnings

    n, me = hvd.size(), hvd.rank()
    big = np.float32(np.finfo(np.float32).max)
    x = np.full(count, big, np.float32)
    x[0] = np.inf if me == 0 else -np.inf  # inf + -inf once two ranks add
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = hvd.allreduce(x, op=hvd.Sum, name=f"overflow.{count}")
        rs = hvd.reducescatter(x, op=hvd.Sum, name=f"overflow.rs.{count}")
    if n == 1:
        assert out[0] == np.inf and np.isfinite(out[1:]).all()
        return
    assert np.isnan(out[0]) and np.isposinf(out[1:]).all()
    if me == 0:  # rank 0's block starts with the nan
        assert np.isnan(rs[0]) and np.isposinf(rs[1:]).all()
    else:
        assert np.isposinf(rs).all()
