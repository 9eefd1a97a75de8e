"""Every `horovod.torch` collective under real ranks, checked against references computed from
every rank's (deterministic) input; valid at any world size.

Launched by tests/parallel/test_torch_driver.py at np 1, 2 and 4, or directly:
`mpirun --allow-run-as-root --oversubscribe -np 2 python -m pytest tests/parallel/test_torch_ops.py`
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
import torch

import horovod.torch as hvd
from tests.parallel._torch_util import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, PS_EVEN, PS_ODD,
                                        SIZE, dname, init_world, rank_tensor)
from tests.parallel._util import assert_close, reference_reduce

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(120)]

OPS = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}


@pytest.fixture(scope="module", autouse=True)
def world():
    init_world()
    yield


def parts(seed: int, shape, dtype, n: int | None = None):
    return [rank_tensor(seed, r, shape, dtype) for r in range(SIZE if n is None else n)]


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 100000


def check_reduce(got: torch.Tensor, ps: list[torch.Tensor], op, pre=1.0, post=1.0,
                 what: str = "") -> None:
    assert got.dtype == ps[0].dtype, f"{what}: dtype {got.dtype} != {ps[0].dtype}"
    if got.dtype == torch.bfloat16:
        want = reference_reduce([p.float().numpy() for p in ps], op, pre, post)
        np.testing.assert_allclose(got.float().numpy(), want, rtol=1e-2, atol=1e-2, err_msg=what)
    else:
        assert_close(got.numpy(), reference_reduce([p.numpy() for p in ps], op, pre, post), what)


# -- basics -------------------------------------------------------------------------------------
def test_basics():
    assert hvd.is_initialized()
    assert hvd.size() == SIZE and 0 <= hvd.rank() < SIZE
    assert hvd.local_size() == SIZE and hvd.local_rank() == hvd.rank()
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    import collective
    mode = collective.mode()  # mpi under mpirun, tcp under hvdrun --gloo
    assert hvd.mpi_built() and hvd.gloo_built() is True
    assert hvd.mpi_enabled() == (mode == "mpi") and hvd.gloo_enabled() == (mode == "tcp")
    if mode == "mpi":
        assert isinstance(hvd.mpi_threads_supported(), bool)
    else:
        with pytest.raises(ValueError):
            hvd.mpi_threads_supported()
    assert isinstance(hvd.nccl_built(), int)
    assert hvd.cuda_built() == (hvd.nccl_built() > 0)
    assert not hvd.rocm_built() and not hvd.ddl_built() and not hvd.ccl_built()
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.mpi_ops.is_homogeneous()
    assert hvd.global_process_set.size() == SIZE and hvd.global_process_set.rank() == hvd.rank()
    assert hvd.global_process_set.included()


# -- allreduce ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
@pytest.mark.parametrize("opname", list(OPS))
def test_allreduce_dtypes_ops(dtype, opname):
    op = OPS[opname]
    if dtype == torch.bool and op == hvd.Average:
        with pytest.raises(ValueError, match="Average of a bool tensor"):
            hvd.allreduce(torch.ones(3, dtype=torch.bool), op=op)
        return
    ps = parts(seed_of(dtype, opname), (3, 5), dtype)
    x = ps[hvd.rank()].clone()
    got = hvd.allreduce(x, op=op, name=f"ar.{dname(dtype)}.{opname}")
    check_reduce(got, ps, op, what=f"allreduce {dtype} {opname}")
    assert torch.equal(x, ps[hvd.rank()]), "allreduce must not modify its input"


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.bfloat16, torch.float64],
                         ids=dname)
def test_allreduce_variants(dtype):
    ps = parts(seed_of("variants", dtype), (4, 3), dtype)
    mine = ps[hvd.rank()]
    pre, post = (0.5, 3.0)
    got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=pre, postscale_factor=post,
                        name="var.scaled")
    check_reduce(got, ps, hvd.Sum, pre, post, "scaled")
    x = mine.clone()
    out = hvd.allreduce_(x, op=hvd.Sum, name="var.inplace")
    assert out is x
    check_reduce(x, ps, hvd.Sum, what="allreduce_")
    h = hvd.allreduce_async(mine, op=hvd.Max, name="var.async")
    assert isinstance(h, int) and isinstance(hvd.poll(h), bool)
    check_reduce(hvd.synchronize(h), ps, hvd.Max, what="allreduce_async")
    y = mine.clone()
    h = hvd.allreduce_async_(y, op=hvd.Min, name="var.async_")
    assert hvd.synchronize(h) is y
    check_reduce(y, ps, hvd.Min, what="allreduce_async_")
    # default op is Average
    check_reduce(hvd.allreduce(mine, name="var.default"), ps, hvd.Average, what="default op")


def test_allreduce_average_flag_and_errors():
    x = torch.ones(3)
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(x, average=False, name="flag.sum"), x * SIZE)
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="Tensor is required to be contiguous"):
        hvd.allreduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match=r"Tensor type torch.ComplexFloatTensor is not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="sparse"):
        hvd.allreduce_async_(torch.ones(3).to_sparse())
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(10 ** 9)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(10 ** 9)
    # a name still pending on this rank is refused; rank 0's "dup" stays pending until the
    # others submit theirs after the barrier
    if hvd.rank() == 0:
        h = hvd.allreduce_async(x, name="dup")
        if SIZE > 1:
            with pytest.raises(ValueError, match="already pending"):
                hvd.allreduce_async(x, name="dup")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(x, name="dup")
    hvd.synchronize(h)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(h)  # a handle is synchronized once


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_allreduce_compression(compression):
    comp = getattr(hvd.Compression, compression)
    ps = [torch.linspace(-1, 1, 7, dtype=torch.float64) * (r + 1) for r in range(SIZE)]
    got = hvd.allreduce(ps[hvd.rank()], op=hvd.Sum, compression=comp, name=f"cmp.{compression}")
    assert got.dtype == torch.float64
    want = sum(ps)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * SIZE)
    ints = torch.arange(5, dtype=torch.int32)
    assert comp.compress(ints)[0] is ints  # non-float tensors pass through


def test_allreduce_mismatch_fails_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(hvd.HorovodInternalError, match="mismatch|shape|Mismatch"):
        hvd.allreduce(torch.ones(hvd.rank() + 1), name="mismatch.shape")
    with pytest.raises(hvd.HorovodInternalError):
        dt = torch.float32 if hvd.rank() == 0 else torch.float64
        hvd.allreduce(torch.ones(2, dtype=dt), name="mismatch.dtype")
    # the runtime keeps working afterwards
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.mismatch"),
                       torch.full((2,), float(SIZE)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=dname)
def test_grouped_allreduce(dtype):
    pss = [parts(seed_of("grouped", dtype, i), (i + 2, 3), dtype) for i in range(3)]
    mine = [p[hvd.rank()] for p in pss]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, name=f"g.{dname(dtype)}")
    assert len(outs) == 3
    for o, p in zip(outs, pss):
        check_reduce(o, p, hvd.Sum, what="grouped_allreduce")
    h = hvd.grouped_allreduce_async(mine, op=hvd.Max, name=f"ga.{dname(dtype)}")
    for o, p in zip(hvd.synchronize(h), pss):
        check_reduce(o, p, hvd.Max, what="grouped_allreduce_async")
    xs = [m.clone() for m in mine]
    res = hvd.grouped_allreduce_(xs, op=hvd.Sum, name=f"gi.{dname(dtype)}")
    assert all(a is b for a, b in zip(res, xs))
    for o, p in zip(xs, pss):
        check_reduce(o, p, hvd.Sum, what="grouped_allreduce_")
    ys = [m.clone() for m in mine]
    hvd.synchronize(hvd.grouped_allreduce_async_(ys, op=hvd.Min, name=f"gia.{dname(dtype)}"))
    for o, p in zip(ys, pss):
        check_reduce(o, p, hvd.Min, what="grouped_allreduce_async_")


# -- allgather / broadcast / alltoall / reducescatter -------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_allgather(dtype):
    ps = [rank_tensor(seed_of("ag", dtype), r, (r + 1, 2, 3), dtype) for r in range(SIZE)]
    got = hvd.allgather(ps[hvd.rank()], name=f"ag.{dname(dtype)}")
    assert torch.equal(got, torch.cat(ps))
    h = hvd.allgather_async(ps[hvd.rank()], name=f"aga.{dname(dtype)}")
    assert torch.equal(hvd.synchronize(h), torch.cat(ps))


def test_allgather_of_a_scalar_is_refused_everywhere():
    # Horovod's message on every rank (its torch wrapper raised a bare IndexError first).
    for fn in (lambda t: hvd.allgather(t, name="ag0"),
               lambda t: hvd.grouped_allgather([t], name="gag0")[0]):
        with pytest.raises(hvd.HorovodInternalError, match="tried to ALLGATHER a rank-zero"):
            fn(torch.tensor(1.0, requires_grad=True))


def test_grouped_allgather():
    a = [torch.full((r + 1, 2), float(r)) for r in range(SIZE)]
    b = [torch.arange(3 * (r + 2), dtype=torch.int32).view(r + 2, 3) for r in range(SIZE)]
    me = hvd.rank()
    ga, gb = hvd.grouped_allgather([a[me], b[me]], name="gag")
    assert torch.equal(ga, torch.cat(a)) and torch.equal(gb, torch.cat(b))
    ga, gb = hvd.synchronize(hvd.grouped_allgather_async([a[me], b[me]], name="gaga"))
    assert torch.equal(ga, torch.cat(a)) and torch.equal(gb, torch.cat(b))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_broadcast(dtype):
    ps = parts(seed_of("bc", dtype), (2, 3), dtype)
    for root in range(SIZE):
        x = ps[hvd.rank()].clone()
        got = hvd.broadcast(x, root, name=f"bc.{dname(dtype)}.{root}")
        assert torch.equal(got, ps[root])
        assert torch.equal(x, ps[hvd.rank()]), "broadcast must not modify its input"
        y = ps[hvd.rank()].clone()
        assert hvd.broadcast_(y, root, name=f"bci.{dname(dtype)}.{root}") is y
        assert torch.equal(y, ps[root])
    z = ps[hvd.rank()].clone()
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(z, 0, name="bca")), ps[0])
    hvd.synchronize(hvd.broadcast_async_(z, SIZE - 1, name="bcai"))
    assert torch.equal(z, ps[SIZE - 1])


def test_broadcast_invalid_root():
    with pytest.raises(ValueError, match="invalid root rank"):
        hvd.broadcast(torch.ones(2), SIZE, name="bad.root")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool],
                         ids=dname)
def test_alltoall(dtype):
    me = hvd.rank()
    # rank r sends (r + d + 1) rows to rank d; row values encode (sender, destination)
    def block(r, d):
        return torch.full((r + d + 1, 2), float((10 * r + d) % 2 if dtype == torch.bool
                                                 else 10 * r + d)).to(dtype)
    send = torch.cat([block(me, d) for d in range(SIZE)])
    splits = [me + d + 1 for d in range(SIZE)]
    out, received = hvd.alltoall(send, splits=splits, name=f"a2a.{dname(dtype)}")
    assert torch.equal(out, torch.cat([block(r, me) for r in range(SIZE)]))
    assert received.dtype == torch.int32 and received.tolist() == [r + me + 1
                                                                   for r in range(SIZE)]
    out2, rec2 = hvd.synchronize(hvd.alltoall_async(send, torch.tensor(splits, dtype=torch.int32),
                                                    name=f"a2aa.{dname(dtype)}"))
    assert torch.equal(out2, out) and torch.equal(rec2, received)
    even = torch.arange(2 * SIZE, dtype=torch.float32) + 100 * me
    got = hvd.alltoall(even, name=f"a2ae.{dname(dtype)}")  # no splits: output only
    assert torch.equal(got, torch.tensor([100 * r + 2 * me + k for r in range(SIZE)
                                          for k in range(2)], dtype=torch.float32))


def test_alltoall_errors():
    with pytest.raises(ValueError, match="Number of entries in splits"):
        hvd.alltoall(torch.ones(4), splits=[1] * (SIZE + 1))
    x = torch.arange(2.0 * SIZE)
    # Non-integral splits fail at the call (never truncated to whole rows), on every path.
    for i, bad in enumerate(([1.5] + [0.5] * (SIZE - 1), torch.full((SIZE,), 0.5),
                             torch.full((SIZE,), 1.5, dtype=torch.bfloat16),
                             np.full(SIZE, 0.5), torch.ones(SIZE, dtype=torch.bool))):
        for call in (lambda: hvd.alltoall(x, splits=bad, name=f"a2a.bad.{i}"),
                     lambda: hvd.synchronize(hvd.alltoall_async(x, bad, name=f"a2a.bad.{i}"))):
            with pytest.raises(ValueError, match="32-bit integer elements") as info:
                call()
            msg = str(info.value)
            for part in (f"'alltoall.a2a.bad.{i}'", f"rank {hvd.rank()}", "whole", "2.0"):
                assert part in msg, (part, msg)
    # Whole floats are row counts; int64 values past int32 are not wrapped to small ones.
    for i, good in enumerate(([2.0] * SIZE, torch.full((SIZE,), 2.0))):
        out, received = hvd.alltoall(x, splits=good, name=f"a2a.whole.{i}")
        assert received.tolist() == [2] * SIZE
        assert out.tolist() == [2.0 * hvd.rank(), 2.0 * hvd.rank() + 1] * SIZE
    with pytest.raises(ValueError, match="Sum of splits entries is greater"):
        hvd.alltoall(x, splits=torch.tensor([2 ** 32 + 1] + [0] * (SIZE - 1)), name="a2a.wide")
    if SIZE > 1:
        with pytest.raises(ValueError, match="even multiple"):
            hvd.alltoall(torch.ones(SIZE + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32],
                         ids=dname)
@pytest.mark.parametrize("opname", ["sum", "avg"])
def test_reducescatter(dtype, opname):
    op = OPS[opname]
    rows = 2 * SIZE + 1  # uneven: the first rank gets one row more
    ps = parts(seed_of("rs", dtype, opname), (rows, 3), dtype)
    got = hvd.reducescatter(ps[hvd.rank()], op=op, name=f"rs.{dname(dtype)}.{opname}")
    full = reference_reduce([p.float().numpy() if dtype == torch.bfloat16 else p.numpy()
                             for p in ps], op)
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:hvd.rank()])
    want = full[start:start + counts[hvd.rank()]]
    assert got.dtype == dtype and tuple(got.shape) == want.shape
    np.testing.assert_allclose(got.float().numpy(), want.astype(np.float64), rtol=1e-2,
                               atol=1e-2)
    h = hvd.reducescatter_async(ps[hvd.rank()], op=op, name=f"rsa.{dname(dtype)}.{opname}")
    assert torch.equal(hvd.synchronize(h), got)


def test_grouped_reducescatter_and_errors():
    a = [torch.full((SIZE * 2, 2), float(r + 1)) for r in range(SIZE)]
    b = [torch.full((SIZE, 3), float(2 * r)) for r in range(SIZE)]
    me = hvd.rank()
    ra, rb = hvd.grouped_reducescatter([a[me], b[me]], op=hvd.Sum, name="grs")
    assert torch.equal(ra, torch.full((2, 2), float(sum(range(1, SIZE + 1)))))
    assert torch.equal(rb, torch.full((1, 3), float(sum(2 * r for r in range(SIZE)))))
    ra2, rb2 = hvd.synchronize(hvd.grouped_reducescatter_async([a[me], b[me]], op=hvd.Sum,
                                                               name="grsa"))
    assert torch.equal(ra2, ra) and torch.equal(rb2, rb)
    got = hvd.reducescatter(torch.full((SIZE, 2), 1.0, dtype=torch.float64),
                            compression=hvd.Compression.fp16, op=hvd.Sum, name="rs.fp16")
    assert got.dtype == torch.float64 and torch.equal(got, torch.full((1, 2), float(SIZE),
                                                                      dtype=torch.float64))
    with pytest.raises(hvd.HorovodInternalError, match="only supports AVERAGE and SUM"):
        hvd.reducescatter(torch.ones(SIZE), op=hvd.Max)


def test_sparse_allreduce_async():
    me = hvd.rank()
    dense = torch.zeros(SIZE + 2, 3)
    dense[me] = me + 1.0
    dense[SIZE + 1] = 1.0  # every rank contributes to the last row
    for op in (hvd.Sum, hvd.Average):
        fn = hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sp.{int(op)}", op=op)
        got = fn()
        assert got.is_sparse
        want = torch.zeros(SIZE + 2, 3)
        for r in range(SIZE):
            want[r] = r + 1.0
        want[SIZE + 1] = float(SIZE)
        if op == hvd.Average:
            want /= SIZE
        torch.testing.assert_close(got.to_dense(), want)


def test_barrier_join_and_process_sets():
    hvd.barrier()
    last = hvd.join()
    assert 0 <= last < SIZE
    assert hvd.allgather(torch.tensor([last]), name="join.same").unique().numel() == 1
    me = hvd.rank()
    mine_set, other = (PS_EVEN, PS_ODD) if me % 2 == 0 else (PS_ODD, PS_EVEN)
    members = mine_set.ranks
    got = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, name="ps.sum",
                        process_set=mine_set)
    assert got.item() == float(sum(members))
    got = hvd.allgather(torch.tensor([me]), name="ps.ag", process_set=mine_set)
    assert got.tolist() == members
    assert hvd.broadcast(torch.tensor([me]), members[-1], name="ps.bc",
                         process_set=mine_set).item() == members[-1]
    hvd.barrier(process_set=mine_set)
    if other is not None:
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(torch.ones(1), process_set=other)


# -- autograd -----------------------------------------------------------------------------------
def test_allreduce_grad():
    for op, factor in ((hvd.Sum, SIZE), (hvd.Average, 1)):
        x = torch.arange(4, dtype=torch.float32, requires_grad=True)
        y = hvd.allreduce(x, op=op, name=f"grad.ar.{int(op)}")
        (y * (hvd.rank() + 1)).sum().backward()
        # backward = allreduce (same op) of dy = rank + 1
        dy = [r + 1.0 for r in range(SIZE)]
        want = sum(dy) if op == hvd.Sum else sum(dy) / SIZE
        torch.testing.assert_close(x.grad, torch.full((4,), want))
        assert factor  # documented: the gradient of Sum is the sum of the upstream gradients


def test_grouped_allreduce_grad():
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grad.gar")
    (ys[0].sum() * 2 + ys[1].sum()).backward()
    torch.testing.assert_close(xs[0].grad, torch.full((2,), 2.0 * SIZE))
    torch.testing.assert_close(xs[1].grad, torch.full((3,), 1.0 * SIZE))


def test_allgather_grad():
    me = hvd.rank()
    x = torch.ones(me + 1, 2, requires_grad=True)
    y = hvd.allgather(x, name="grad.ag")
    w = torch.arange(y.shape[0], dtype=torch.float32).unsqueeze(1) * (me + 1)
    (y * w).sum().backward()
    # Average over ranks of w, then this rank's rows
    mean_scale = sum(r + 1 for r in range(SIZE)) / SIZE
    start = sum(r + 1 for r in range(me))
    want = (torch.arange(start, start + me + 1, dtype=torch.float32) * mean_scale).unsqueeze(1)
    torch.testing.assert_close(x.grad, want.expand(me + 1, 2))
    a = torch.ones(me + 1, requires_grad=True)
    b = torch.ones(2, 2, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b], name="grad.gag")
    (ga.sum() + 3 * gb.sum()).backward()
    torch.testing.assert_close(a.grad, torch.ones(me + 1))
    torch.testing.assert_close(b.grad, torch.full((2, 2), 3.0))
    # Members without a gradient (bool, integers) beside one with: only that one is reduced
    # (an Average of bool zeros was refused on every rank).
    c = torch.ones(me + 1, 2, requires_grad=True)
    gc, _, _ = hvd.grouped_allgather([c, torch.ones(2, dtype=torch.bool),
                                      torch.arange(me + 1)], name="grad.gag.mixed")
    (gc.sum() * 2).backward()
    torch.testing.assert_close(c.grad, torch.full((me + 1, 2), 2.0))


def test_broadcast_grad():
    root = SIZE - 1
    x = torch.full((3,), float(hvd.rank()), requires_grad=True)
    y = hvd.broadcast(x, root, name="grad.bc")
    assert torch.equal(y.detach(), torch.full((3,), float(root)))
    (y * (hvd.rank() + 1)).sum().backward()
    want = sum(r + 1 for r in range(SIZE)) / SIZE if hvd.rank() == root else 0.0
    torch.testing.assert_close(x.grad, torch.full((3,), want))


def test_alltoall_grad():
    me = hvd.rank()
    splits = [me + d + 1 for d in range(SIZE)]
    x = torch.ones(sum(splits), 2, requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits, name="grad.a2a")
    # gradient row value = sender rank + 1, so the gradient coming back equals my dy
    (out * (me + 1)).sum().backward()
    want = torch.cat([torch.full((splits[d], 2), float(d + 1)) for d in range(SIZE)])
    torch.testing.assert_close(x.grad, want)


def test_alltoall_grad_with_rows_left_unsent():
    # splits may cover fewer rows than the tensor has (only more is an error); the rows left
    # unsent get a zero gradient (the backward pass used to return too few rows, which autograd
    # rejected).
    me = hvd.rank()
    x = torch.ones(SIZE + 2, 2, requires_grad=True)
    out, received = hvd.alltoall(x, splits=[1] * SIZE, name="grad.a2a.short")
    assert out.shape == (SIZE, 2) and received.tolist() == [1] * SIZE
    (out * (me + 1)).sum().backward()
    want = torch.cat([torch.arange(1.0, SIZE + 1).view(-1, 1).expand(-1, 2), torch.zeros(2, 2)])
    torch.testing.assert_close(x.grad, want)


def test_reducescatter_grad():
    me = hvd.rank()
    for op in (hvd.Sum, hvd.Average):
        x = torch.ones(2 * SIZE, 2, requires_grad=True)
        y = hvd.reducescatter(x, op=op, name=f"grad.rs.{int(op)}", prescale_factor=2.0)
        (y * (me + 1)).sum().backward()
        factor = 2.0 * (SIZE if op == hvd.Sum else 1)
        want = torch.cat([torch.full((2, 2), (r + 1) * factor) for r in range(SIZE)])
        torch.testing.assert_close(x.grad, want)
    xs = [torch.ones(SIZE, 1, requires_grad=True), torch.ones(2 * SIZE, 1, requires_grad=True)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="grad.grs")
    (ys[0].sum() + ys[1].sum() * 2).backward()
    torch.testing.assert_close(xs[0].grad, torch.full((SIZE, 1), float(SIZE)))
    torch.testing.assert_close(xs[1].grad, torch.full((2 * SIZE, 1), 2.0 * SIZE))


def test_second_derivatives_flow_through_the_collectives():
    # The backward passes are the differentiable collectives themselves (as Horovod's): with
    # create_graph=True the gradient can be differentiated again (a gradient penalty, a
    # Hessian-vector product). Before, it had no grad_fn: an error, or a missing term.
    me = hvd.rank()
    x = torch.full((3,), float(me + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, name="hess.ar")
    loss = (x ** 2).sum() + (y ** 3).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    s = float(sum(r + 1 for r in range(SIZE)))  # y on every rank
    # dloss/dx = 2x + Sum_r 3 y^2 = 2x + 3 SIZE s^2; its derivative: 2 + Sum_r 6 y * SIZE
    torch.testing.assert_close(g.detach(), 2 * x.detach() + 3 * SIZE * s ** 2)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(h, torch.full((3,), 2.0 + 6.0 * s * SIZE * SIZE))
    # broadcast, allgather, alltoall and reducescatter: the penalty's gradient exists and is
    # the same as through a plain copy (each is linear, so the second derivative of a cube
    # through it is defined).
    z = torch.full((2,), float(me + 1), requires_grad=True)
    for i, fn in enumerate((lambda t: hvd.broadcast(t, 0, name="hess.bc"),
                            lambda t: hvd.allgather(t, name="hess.ag"),
                            lambda t: hvd.alltoall(t.repeat(SIZE), name="hess.a2a"),
                            lambda t: hvd.reducescatter(t.repeat(SIZE), op=hvd.Sum,
                                                        name="hess.rs"))):
        (gz,) = torch.autograd.grad((fn(z) ** 3).sum(), z, create_graph=True)
        assert gz.grad_fn is not None, i
        (hz,) = torch.autograd.grad(gz.sum(), z)
        assert hz.shape == z.shape and torch.isfinite(hz).all(), i


def test_int_handles_keep_tensors_alive():
    hs = [hvd.allreduce_async(torch.full((1000,), float(i)), op=hvd.Sum, name=f"alive.{i}")
          for i in range(8)]
    import gc
    gc.collect()
    for i, h in enumerate(hs):
        assert torch.equal(hvd.synchronize(h), torch.full((1000,), float(i * SIZE)))


def test_deprecation_warning_points_at_caller():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hvd.allreduce_(torch.ones(1), average=True, name="warn.avg")
    assert any(issubclass(x.category, DeprecationWarning) for x in w)


def test_dtype_tables_documented():
    # ringvod extends Horovod's torch dtypes: every dtype below works for every op
    assert set(INT_DTYPES + FLOAT_DTYPES) <= set(ALL_DTYPES)
