"""The loopback control plane and engine (N threads = N ranks), and the shared HostEngine logic
they exercise: primitives, split, abort and timeout, fusion-buffer packing, scaling, Average,
bool/float16/bfloat16 handling, reducescatter layout."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from collective.config import read_env
from collective.engines.base import bf16_to_f32, f32_to_bf16, split_rows
from collective.engines.loopback import LoopbackEngine, LoopbackWorld, create_single_backend
from collective.entry import Entry
from collective.errors import CollectiveTimeoutError, HorovodInternalError
from collective.handle import Handle
from collective.types import (DataType, ReduceOp, Request, RequestType, Response, ResponseType,
                              dtype_of)

pytestmark = pytest.mark.timeout(60)


def on_ranks(n, fn, world=None, timeout=20.0):
    """Runs fn(rank, world) on n threads; returns results; re-raises the first exception."""
    world = world or LoopbackWorld(n, timeout=10.0)
    out, errs = [None] * n, []

    def run(r):
        try:
            out[r] = fn(r, world)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    ts = [threading.Thread(target=run, args=(r,), name=f"lb-{r}") for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "loopback threads hung"
    if errs:
        raise errs[0]
    return out


# -- control plane ------------------------------------------------------------------------------
def test_plane_primitives():
    def body(r, w):
        p = w.plane(r)
        assert (p.rank, p.size) == (r, 3)
        g = p.gather(bytes([r]))
        b = p.bcast(b"root" if r == 0 else None)
        words = np.array([0b111 ^ (1 << r), 1 << r], dtype=np.uint64)
        a = p.allreduce_words(words, "and")
        o = p.allreduce_words(words, "or")
        ag = p.allgather(str(r).encode())
        p.barrier()
        return g, b, a.tolist(), o.tolist(), ag

    out = on_ranks(3, body)
    assert out[0][0] == [b"\x00", b"\x01", b"\x02"] and out[1][0] is None
    assert all(o[1] == b"root" for o in out)
    assert all(o[2] == [0, 0] and o[3] == [7, 7] for o in out)
    assert all(o[4] == [b"0", b"1", b"2"] for o in out)


def test_split_gives_subgroups_and_none_for_non_members():
    def body(r, w):
        sub = w.plane(r).split([1, 3])
        if sub is None:
            return None
        return sub.rank, sub.size, sub.global_ranks, sub.allgather(bytes([r]))

    out = on_ranks(4, body)
    assert out[0] is None and out[2] is None
    assert out[1] == (0, 2, [1, 3], [b"\x01", b"\x03"])
    assert out[3] == (1, 2, [1, 3], [b"\x01", b"\x03"])


def test_abort_wakes_blocked_peers_with_the_reason():
    w = LoopbackWorld(2, timeout=10.0)
    p0 = w.plane(0)
    threading.Timer(0.1, w.plane(1).abort, args=("peer died",)).start()
    t0 = time.monotonic()
    with pytest.raises(HorovodInternalError, match="peer died"):
        p0.barrier()
    assert time.monotonic() - t0 < 5.0


def test_missing_peer_times_out():
    w = LoopbackWorld(2, timeout=0.2)
    with pytest.raises(CollectiveTimeoutError, match="did not arrive within 0.2 s"):
        w.plane(0).barrier()


def test_single_backend_is_size_one():
    p = create_single_backend(read_env({}))
    assert (p.rank, p.size) == (0, 1)
    assert p.gather(b"x") == [b"x"] and p.bcast(b"y") == b"y"


# -- engine -------------------------------------------------------------------------------------
def entry(t, name, kind=RequestType.ALLREDUCE, output=None):
    req = Request(rank=0, type=kind, name=name, dtype=dtype_of(t), shape=t.shape)
    return Entry(req, t, Handle(name), output=output)


def resp(entries, kind=ResponseType.ALLREDUCE, op=ReduceOp.SUM, pre=1.0, post=1.0, dtype=None):
    return Response(type=kind, names=[e.name for e in entries],
                    dtype=dtype or entries[0].request.dtype,
                    sizes=[e.tensor.size for e in entries], reduce_op=op, prescale=pre,
                    postscale=post, shapes=[e.tensor.shape for e in entries])


def engines(n, fn, threshold=1 << 20):
    return on_ranks(n, lambda r, w: fn(r, LoopbackEngine(w.plane(r), threshold)))


def test_fused_allreduce_packs_and_unpacks_every_tensor():
    def body(r, eng):
        es = [entry(np.full(k + 1, float(r + k), dtype=np.float32), f"t{k}") for k in range(5)]
        eng.allreduce(es, resp(es))
        return [e.output for e in es]

    for outs in engines(2, body):
        for k, o in enumerate(outs):
            np.testing.assert_allclose(o, np.full(k + 1, 1.0 + 2 * k))


def test_average_and_scaling_float_and_int():
    def body(r, eng):
        f = entry(np.full(3, float(r + 1)), "f")
        eng.allreduce([f], resp([f], op=ReduceOp.AVERAGE, pre=2.0, post=3.0))
        i = entry(np.full(3, r + 1, dtype=np.int32), "i")
        eng.allreduce([i], resp([i], op=ReduceOp.AVERAGE))  # (1 + 2) / 2 -> 1 (truncates)
        return f.output, i.output

    for f, i in engines(2, body):
        np.testing.assert_allclose(f, np.full(3, (2 + 4) / 2 * 3))
        np.testing.assert_array_equal(i, np.full(3, 1, dtype=np.int32))


def test_in_place_output_is_the_input():
    def body(r, eng):
        t = np.full(4, float(r))
        e = entry(t, "x", output=t)
        eng.allreduce([e], resp([e]))
        return t

    for t in engines(3, body):
        np.testing.assert_allclose(t, np.full(4, 3.0))


@pytest.mark.parametrize("op,want", [(ReduceOp.SUM, [True, True, False]),
                                     (ReduceOp.MAX, [True, True, False]),
                                     (ReduceOp.MIN, [True, False, False]),
                                     (ReduceOp.PRODUCT, [True, False, False])])
def test_bool_reduces_as_logical_or_and(op, want):
    vals = [np.array([True, True, False]), np.array([True, False, False])]

    def body(r, eng):
        e = entry(vals[r].copy(), "b")
        eng.allreduce([e], resp([e], op=op))
        return e.output

    for out in engines(2, body):
        np.testing.assert_array_equal(out, want)


def test_float16_and_bfloat16_reduce_through_float32():
    def body(r, eng):
        h = entry(np.full(4, 0.5 + r, dtype=np.float16), "h")
        eng.allreduce([h], resp([h], post=0.5))
        bits = np.empty(4, dtype=np.uint16)
        f32_to_bf16(np.full(4, 1.5 + r, dtype=np.float32), bits)
        b = Entry(Request(rank=0, type=RequestType.ALLREDUCE, name="bf", dtype=DataType.BFLOAT16,
                          shape=(4,)), bits, Handle("bf"))
        eng.allreduce([b], resp([b], dtype=DataType.BFLOAT16))
        return h.output, bf16_to_f32(b.output)

    for h, b in engines(2, body):
        assert h.dtype == np.float16
        np.testing.assert_allclose(h.astype(np.float32), np.full(4, 1.0))
        np.testing.assert_allclose(b, np.full(4, 4.0))


def test_bf16_round_trip_and_rounding():
    vals = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, np.nan, np.inf], dtype=np.float32)
    bits = np.empty(vals.shape, dtype=np.uint16)
    f32_to_bf16(vals, bits)
    back = bf16_to_f32(bits)
    finite = np.isfinite(vals)
    np.testing.assert_allclose(back[finite], vals[finite], rtol=2 ** -8)
    assert np.isnan(back[5]) and np.isinf(back[6])
    # Round to nearest even: 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1+2^-7.
    f32_to_bf16(np.array([1 + 2 ** -8], dtype=np.float32), bits[:1])
    assert bf16_to_f32(bits[:1])[0] == 1.0


def test_allgather_fused_variable_rows():
    def body(r, eng):
        a = entry(np.full((r + 1, 2), r, dtype=np.int64), "a", RequestType.ALLGATHER)
        b = entry(np.full((2 - r,), 10 + r, dtype=np.int64), "b", RequestType.ALLGATHER)
        rsp = Response(type=ResponseType.ALLGATHER, names=["a", "b"], dtype=DataType.INT64,
                       sizes=[1, 2, 2, 1], shapes=[(r + 1, 2), (2 - r,)])
        eng.allgather([a, b], rsp)
        return a.output, b.output

    for a, b in engines(2, body):
        np.testing.assert_array_equal(a, [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(b, [10, 10, 11])


def test_broadcast_and_alltoall():
    def body(r, eng):
        e = entry(np.full(3, r), "bc", RequestType.BROADCAST)
        eng.broadcast(e, root=2)
        t = np.arange(6).reshape(3, 2) + 100 * r
        a = entry(t, "a2a", RequestType.ALLTOALL)
        a.splits = np.array([1, 0, 2], dtype=np.int32)
        eng.alltoall(a)
        return e.output, a.output, a.received_splits

    out = engines(3, body)
    for r, (bc, a2a, recv) in enumerate(out):
        np.testing.assert_array_equal(bc, np.full(3, 2))
        want_recv = [[1, 0, 2][r]] * 3
        np.testing.assert_array_equal(recv, want_recv)
        assert recv.dtype == np.int32
    np.testing.assert_array_equal(out[0][1], [[0, 1], [100, 101], [200, 201]])
    assert out[1][1].shape == (0, 2)
    np.testing.assert_array_equal(out[2][1], [[2, 3], [4, 5], [102, 103], [104, 105],
                                              [202, 203], [204, 205]])


@pytest.mark.parametrize("dim0,size", [(7, 3), (2, 3), (0, 2), (6, 2)])
def test_reducescatter_layout(dim0, size):
    assert split_rows(dim0, size) == [dim0 // size + (1 if r < dim0 % size else 0)
                                      for r in range(size)]

    def body(r, eng):
        e = entry(np.arange(dim0 * 2, dtype=np.float64).reshape(dim0, 2), "rs",
                  RequestType.REDUCESCATTER)
        eng.reducescatter([e], resp([e], kind=ResponseType.REDUCESCATTER))
        return e.output

    full = np.arange(dim0 * 2, dtype=np.float64).reshape(dim0, 2) * size
    counts = split_rows(dim0, size)
    for r, out in enumerate(engines(size, body)):
        start = sum(counts[:r])
        np.testing.assert_allclose(out, full[start:start + counts[r]])


def test_zeros_for_joined_ranks():
    eng = LoopbackEngine(LoopbackWorld(1).plane(0), 1024)
    z = eng.zeros((2, 3), DataType.FLOAT16, -1)
    assert z.dtype == np.float16 and z.shape == (2, 3) and not z.any()
