"""The NCCL engine's logic on a fake GPU (tests/gpu/_fakecuda.py), with loopback ranks.

Run by tests/gpu/test_engine_fake.py in a fresh interpreter (the fake CuPy must be installed
before `collective.engines.nccl` is imported). Prints one line per case and a summary line
'N passed, M failed'; exits non-zero on any failure.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu import _fakecuda  # noqa: E402

_fakecuda.install()

import numpy as np  # noqa: E402

import collective  # noqa: E402
from collective import DataType, ReduceOp, RequestType  # noqa: E402
from collective.engines.base import bf16_to_f32, f32_to_bf16, split_rows  # noqa: E402
from collective.engines.device import DeviceResult  # noqa: E402
from tests._spmd import run_loopback  # noqa: E402
from tests.gpu._fakecuda import FakeArray  # noqa: E402

NP = {DataType.UINT8: np.uint8, DataType.INT8: np.int8, DataType.INT32: np.int32,
      DataType.INT64: np.int64, DataType.FLOAT16: np.float16, DataType.FLOAT32: np.float32,
      DataType.FLOAT64: np.float64, DataType.BFLOAT16: np.uint16, DataType.BOOL: np.bool_}


def data(rank: int, shape: tuple, dt: DataType, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 7 * salt + 1)
    if dt == DataType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    if dt == DataType.BFLOAT16:
        out = np.empty(shape, np.uint16)
        f32_to_bf16(rng.integers(-8, 8, shape).astype(np.float32), out)
        return out
    if dt in (DataType.UINT8,):
        return rng.integers(0, 3, shape).astype(np.uint8)
    return rng.integers(-3, 4, shape).astype(NP[dt])


def reference(arrs: list[np.ndarray], dt: DataType, op: ReduceOp, pre: float = 1.0,
              post: float = 1.0) -> np.ndarray:
    n = len(arrs)
    if dt == DataType.BOOL:
        f = np.logical_or.reduce if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and.reduce
        return f(arrs)
    xs = [bf16_to_f32(a) if dt == DataType.BFLOAT16 else a.astype(np.float64) for a in arrs]
    xs = [x * pre for x in xs]
    if dt != DataType.BFLOAT16 and np.dtype(NP[dt]).kind in "iu" and pre != 1.0:
        xs = [np.trunc(x) for x in xs]  # integers are scaled (and truncated) before the reduce
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        r = np.sum(xs, axis=0)
    elif op == ReduceOp.PRODUCT:
        r = np.prod(xs, axis=0)
    elif op == ReduceOp.MAX:
        r = np.max(xs, axis=0)
    else:
        r = np.min(xs, axis=0)
    r = r * post / (n if op == ReduceOp.AVERAGE else 1)
    if dt == DataType.BFLOAT16:
        out = np.empty(r.shape, np.uint16)
        f32_to_bf16(r.astype(np.float32), out)
        return out
    if np.dtype(NP[dt]).kind in "iu":
        return np.trunc(r).astype(NP[dt])
    return r.astype(NP[dt])


def enq(kind: RequestType, arrays: list[np.ndarray], dt: DataType, **kw) -> collective.Handle:
    fas = [FakeArray.of(a) for a in arrays]
    outs = kw.pop("inplace", False)
    return collective.adapter.enqueue(kind, fas, device=0, dtypes=[dt] * len(fas),
                              shapes=[a.shape for a in arrays],
                              ready_events=[4242 + i for i in range(len(fas))],
                              outputs=fas if outs else None, grouped=len(fas) > 1, **kw)


def value(res) -> np.ndarray:
    assert isinstance(res, DeviceResult), type(res)
    out = res.output
    return out.get()


def close(a: np.ndarray, b: np.ndarray, dt: DataType) -> bool:
    if dt == DataType.BFLOAT16:
        return np.allclose(bf16_to_f32(a), bf16_to_f32(b), rtol=1e-2, atol=1e-2)
    if dt == DataType.FLOAT16:
        return np.allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-3, atol=1e-3)
    return np.array_equal(a, b) if np.dtype(NP[dt]).kind in "biu" else np.allclose(a, b)


CASES = []


def case(fn):
    CASES.append(fn)
    return fn


@case
def allreduce_dtypes_ops(n: int) -> None:
    def body(rank: int) -> None:
        for dt in NP:
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT,
                       ReduceOp.AVERAGE):
                if dt == DataType.BOOL and op == ReduceOp.AVERAGE:
                    continue
                shape = (5, 3)
                x = data(rank, shape, dt, int(op))
                got = value(enq(RequestType.ALLREDUCE, [x], dt, op=op,
                                name=f"ar.{dt.name}.{op.name}").wait(10))
                want = reference([data(r, shape, dt, int(op)) for r in range(n)], dt, op)
                assert close(got, want, dt), (dt, op, got, want)
    run_loopback(n, body)


@case
def allreduce_fused_scaled_inplace(n: int) -> None:
    shapes = [(1,), (17,), (4, 5), (0,), (1000,), (3, 3, 3)]

    def body(rank: int) -> None:
        for dt in (DataType.FLOAT32, DataType.BFLOAT16, DataType.INT32, DataType.FLOAT16):
            xs = [data(rank, s, dt, i) for i, s in enumerate(shapes)]
            fas = [FakeArray.of(x) for x in xs]
            h = collective.adapter.enqueue(RequestType.ALLREDUCE, fas, device=0, dtypes=[dt] * len(fas),
                                   shapes=shapes, outputs=fas, grouped=True, op=ReduceOp.AVERAGE,
                                   prescale=0.5, postscale=3.0, name=f"fused.{dt.name}")
            res = h.wait(10)
            assert len(res) == len(shapes)
            for i, s in enumerate(shapes):
                want = reference([data(r, s, dt, i) for r in range(n)], dt, ReduceOp.AVERAGE,
                                 0.5, 3.0)
                assert res[i].output is fas[i]
                assert close(fas[i].a, want, dt), (dt, i, fas[i].a, want)
    before = _fakecuda.calls.get("ringvod_batched_copy", 0)
    run_loopback(n, body)
    assert _fakecuda.calls.get("ringvod_batched_copy", 0) > before


@case
def large_members_of_a_fused_allreduce_skip_the_fusion_buffer(n: int) -> None:
    # Members of DIRECT_BYTES or more get an NCCL call of their own in the fused op's group
    # (in place, or into an allocated output); the rest still go through the fusion buffer.
    from collective.engines.nccl import engine as eng
    shapes = [(40,), (3,), (0,), (64,), (5, 2), (100,)]
    # (dtype, in place, op, prescale, postscale); the last: every member direct
    runs = ((DataType.FLOAT32, True, ReduceOp.AVERAGE, 0.5, 3.0, shapes),
            (DataType.FLOAT32, False, ReduceOp.AVERAGE, 0.5, 3.0, shapes),
            (DataType.BFLOAT16, True, ReduceOp.AVERAGE, 0.5, 3.0, shapes),
            (DataType.INT32, False, ReduceOp.SUM, 1.0, 1.0, shapes),
            (DataType.FLOAT32, False, ReduceOp.SUM, 1.0, 2.0, [(40,), (64,)]))

    def body(rank: int) -> None:
        for k, (dt, inplace, op, pre, post, shp) in enumerate(runs):
            xs = [data(rank, s, dt, i) for i, s in enumerate(shp)]
            fas = [FakeArray.of(x) for x in xs]
            h = collective.adapter.enqueue(
                RequestType.ALLREDUCE, fas, device=0, dtypes=[dt] * len(fas), shapes=shp,
                outputs=fas if inplace else None, grouped=True, op=op, prescale=pre,
                postscale=post, name=f"direct.{k}")
            res = h.wait(10)
            for i, s in enumerate(shp):
                want = reference([data(r, s, dt, i) for r in range(n)], dt, op, pre, post)
                got = fas[i].a if inplace else value(res[i])
                assert got.shape == tuple(s), (dt, i, got.shape)
                assert close(got, want, dt), (dt, i, got, want)
                if not inplace:
                    assert np.array_equal(fas[i].a, xs[i]), "the input was written"
        # The same tensor twice, and two overlapping views: every member gets the sum, as
        # through the fusion buffer (NCCL calls of their own would race on shared memory; the
        # packed members get the calls they would have had, which other ranks may make).
        x = data(rank, (64,), DataType.FLOAT32, 9)
        fa = FakeArray.of(x)
        small = FakeArray.of(data(rank, (3,), DataType.FLOAT32, 10))
        collective.adapter.enqueue(
            RequestType.ALLREDUCE, [fa, fa, small], device=0, dtypes=[DataType.FLOAT32] * 3,
            shapes=[(64,), (64,), (3,)], outputs=[fa, fa, small], grouped=True,
            op=ReduceOp.SUM, name="direct.twice").wait(10)
        want = reference([data(r, (64,), DataType.FLOAT32, 9) for r in range(n)],
                         DataType.FLOAT32, ReduceOp.SUM)
        assert close(fa.a, want, DataType.FLOAT32), (fa.a, want)
        y = data(rank, (80,), DataType.FLOAT32, 11)
        whole = FakeArray.of(y)
        part = FakeArray.wrap(whole.a[20:70])
        collective.adapter.enqueue(
            RequestType.ALLREDUCE, [whole, part], device=0, dtypes=[DataType.FLOAT32] * 2,
            shapes=[(80,), (50,)], outputs=[whole, part], grouped=True, op=ReduceOp.SUM,
            name="direct.views").wait(10)
        want = reference([data(r, (80,), DataType.FLOAT32, 11) for r in range(n)],
                         DataType.FLOAT32, ReduceOp.SUM)
        assert close(whole.a, want, DataType.FLOAT32), (whole.a, want)

    saved = eng.DIRECT_BYTES
    eng.DIRECT_BYTES = 100  # float32/int32: 160, 256 and 400 bytes; bfloat16: 128 and 200
    before = dict(_fakecuda.calls)
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    try:
        run_loopback(n, body, timeline=path)
    finally:
        eng.DIRECT_BYTES = saved

    def delta(name: str) -> int:
        return _fakecuda.calls.get(name, 0) - before.get(name, 0)
    big = [[int(np.prod(s)) * r[0].itemsize >= 100 for s in r[5]] for r in runs]
    assert min(sum(b) for b in big) >= 2 and all(big[-1])
    # One call per direct member, one for the buffer when a member is packed; the two ops
    # whose members share memory go through the buffer, with the same calls (two large
    # members and a small one; two large ones).
    calls = sum(sum(b) + (not all(b)) for b in big) + 3 + 2
    assert delta("allReduce") == n * calls, (calls, delta("allReduce"))
    packed = sum(int(np.prod(s)) * r[0].itemsize for r, b in zip(runs, big)
                 for s, d in zip(r[5], b) if not d) + 4 * (64 + 64 + 3) + 4 * (80 + 50)
    assert delta("batched_copy_bytes") == n * 2 * packed, (packed, delta("batched_copy_bytes"))
    with open(path) as f:
        trace = f.read()
    for activity in ("NCCL_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"):
        assert activity in trace, activity


@case
def the_fusion_buffer_grows_to_what_fused_ops_pack(n: int) -> None:
    # Powers of two from 1 MiB up to the fusion threshold: a job that packs little (large
    # members are reduced where they lie) does not hold a threshold-sized buffer.
    from collective import _current as runtime
    mib = 1 << 20
    # (float32 elements of each of two members, fusion buffer bytes after the op); the last
    # op's 7 MiB, more than the 6 MiB threshold, run as fused ops that fit under it.
    steps = ((1000, mib), (mib // 8, mib), (mib // 8 + 4, 2 * mib), (3 * mib // 8, 4 * mib),
             (1000, 4 * mib), (5 * mib // 8, 6 * mib), (7 * mib // 8, 6 * mib))

    def body(rank: int) -> list[int]:
        sizes = []
        old = None
        for k, (count, _) in enumerate(steps):
            xs = [data(rank, (count,), DataType.FLOAT32, i) for i in range(2)]
            fas = [FakeArray.of(x) for x in xs]
            collective.adapter.enqueue(
                RequestType.ALLREDUCE, fas, device=0, dtypes=[DataType.FLOAT32] * 2,
                shapes=[(count,)] * 2, outputs=fas, grouped=True, op=ReduceOp.SUM,
                name=f"grow.{k}").wait(10)
            want = reference([data(r, (count,), DataType.FLOAT32, 0) for r in range(n)],
                             DataType.FLOAT32, ReduceOp.SUM)
            assert close(fas[0].a, want, DataType.FLOAT32), k
            eng = runtime.current().member_sets()[0].device_engine
            if old is not None and eng._fusion_obj is not old:
                # The outgrown buffer (ops before may still use it, and not every framework's
                # allocator orders its reuse on the engine's stream) stays referenced until
                # the op that outgrew it is done.
                assert any(rec[1][1] == [old] for rec in eng._inflight
                           if type(rec[1]) is tuple), k
            old = eng._fusion_obj
            sizes.append(eng._fusion_bytes)
        return sizes

    from collective.engines.nccl import engine as eng
    saved = eng.DIRECT_BYTES
    eng.DIRECT_BYTES = 0  # every member packed
    try:
        # A threshold of 6 MiB caps the doubling.
        got = run_loopback(n, body, fusion_threshold=6 * mib)
    finally:
        eng.DIRECT_BYTES = saved
    want = [b for _, b in steps]
    assert all(g == want for g in got), (got, want)


@case
def a_new_sets_first_op_on_a_user_thread_leaves_the_threads_device(n: int) -> None:
    # The global set's engine is bound, so a synchronous op of a new set runs (and binds that
    # set's engine) on the user's thread: the thread, whose current device is 0 while its
    # tensors live on cuda:<rank>, gets device 0 back, not the engine's.
    from collective import _current as runtime
    from collective.engines import device
    from collective.ops import wait_now

    def body(rank: int) -> list[int]:
        x = FakeArray.of(np.full(5, 1.0, np.float32))
        collective.adapter.enqueue(RequestType.ALLREDUCE, [x], device=rank,
                                   dtypes=[DataType.FLOAT32], shapes=[(5,)],
                                   ready_events=[device.record_ready(rank, 0)],
                                   op=ReduceOp.SUM, name="bind").wait(10)
        seen = []
        for k in range(3):
            ps = collective.add_process_set(list(range(n)))
            time.sleep(0.2)  # the coordinator thread idle: this thread drives the op's cycle
            y = FakeArray.of(np.full(5, 2.0, np.float32))
            kw = dict(device=rank, dtypes=[DataType.FLOAT32], shapes=[(5,)],
                      ready_events=[device.record_ready(rank, 0)], op=ReduceOp.SUM,
                      name=f"new.{k}", process_set=ps)
            res = wait_now(collective.synchronize, lambda: collective.adapter.enqueue(
                RequestType.ALLREDUCE, [y], **kw))
            assert float(res.output.get()[0]) == 2.0 * n
            assert runtime.current()._sets[ps.process_set_id].device_engine.device == rank
            seen.append(_fakecuda._current_device())
            collective.remove_process_set(ps)
        return seen

    assert run_loopback(n, body, dynamic_process_sets=True) == [[0, 0, 0]] * n


@case
def a_removed_process_set_closes_its_device_engine(n: int) -> None:
    # remove_process_set() drains the set's GPU work and destroys its communicator, as the
    # world's shutdown does for every set (the set's NCCL engine, stream and fusion buffer
    # stayed alive before).
    from collective import _current as runtime

    def body(rank: int) -> bool | None:
        ps = collective.add_process_set([0, 1])
        eng = None
        if rank < 2:
            x = data(rank, (300,), DataType.FLOAT32)
            fas = [FakeArray.of(x), FakeArray.of(x)]
            collective.adapter.enqueue(RequestType.ALLREDUCE, fas, device=0,
                                       dtypes=[DataType.FLOAT32] * 2, shapes=[(300,)] * 2,
                                       outputs=fas, grouped=True, op=ReduceOp.SUM,
                                       process_set=ps, name="in.set").wait(10)
            eng = runtime.current()._sets[ps.process_set_id].device_engine
            assert eng.comm is not None
        assert collective.remove_process_set(ps)
        return None if eng is None else eng.comm is None and eng._fusion_obj is None

    got = run_loopback(n, body, dynamic_process_sets=True)
    assert got[:2] == [True, True] and all(g is None for g in got[2:]), got


@case
def a_rank_joined_before_its_first_device_op_uses_the_device_it_named(n: int) -> None:
    # The last rank joins at once, naming its GPU (the torch adapter names the caller's
    # current one): its zeros for the others' device op, its first device work, are made
    # there, not on the device the peers' response names (which another rank owns).
    from collective import _current as runtime

    def body(rank: int) -> int:
        if rank == n - 1:
            collective.ops.join(5)
        else:
            x = data(rank, (6,), DataType.FLOAT32, 1)
            got = value(enq(RequestType.ALLREDUCE, [x], DataType.FLOAT32, op=ReduceOp.SUM,
                            name="early.join").wait(10))
            parts = [data(r, (6,), DataType.FLOAT32, 1) for r in range(n - 1)]
            want = reference(parts + [np.zeros(6, np.float32)], DataType.FLOAT32, ReduceOp.SUM)
            assert close(got, want, DataType.FLOAT32), (got, want)
            collective.ops.join(-1)
        return runtime.current().member_sets()[0].device_engine.device

    devices = run_loopback(n, body)
    assert devices[-1] == 5 and devices[0] == 0, devices


@case
def members_sharing_memory_make_the_calls_of_a_rank_whose_members_do_not(n: int) -> None:
    # The last rank joined: its zeros for a fused op are separate arrays, so its large members
    # get NCCL calls of their own. The others pass the same tensor twice (members sharing
    # memory go through the fusion buffer), yet must make the same NCCL calls, one per large
    # member and one for the rest: else the ranks' calls differ (on a GPU, a hang).
    from collective.engines.nccl import engine as eng

    def body(rank: int) -> None:
        enq(RequestType.ALLREDUCE, [np.ones(4, np.float32)], DataType.FLOAT32,
            name="bind").wait(10)
        if rank == n - 1:
            collective.ops.join(0)
            return
        x = data(rank, (64,), DataType.FLOAT32, 1)
        fa = FakeArray.of(x)
        small = FakeArray.of(data(rank, (3,), DataType.FLOAT32, 2))
        collective.adapter.enqueue(
            RequestType.ALLREDUCE, [fa, small, fa], device=0, dtypes=[DataType.FLOAT32] * 3,
            shapes=[(64,), (3,), (64,)], outputs=[fa, small, fa], grouped=True,
            op=ReduceOp.AVERAGE, postscale=2.0, name="shared.join").wait(10)
        # Joined ranks contribute zeros; Average divides by every rank.
        for got, s, i in ((fa.a, (64,), 1), (small.a, (3,), 2)):
            parts = [data(r, s, DataType.FLOAT32, i) for r in range(n - 1)]
            want = reference(parts + [np.zeros(s, np.float32)], DataType.FLOAT32,
                             ReduceOp.AVERAGE, 1.0, 2.0)
            assert close(got, want, DataType.FLOAT32), (s, got, want)
        collective.ops.join(0)

    saved = eng.DIRECT_BYTES
    eng.DIRECT_BYTES = 100  # the 64-element members (256 bytes)
    before = _fakecuda.calls.get("allReduce", 0)
    try:
        run_loopback(n, body)
    finally:
        eng.DIRECT_BYTES = saved
    # Every rank: the bind op, then three calls (two large members, the small one).
    assert _fakecuda.calls.get("allReduce", 0) - before == n * 4


@case
def allgather_uneven(n: int) -> None:
    def rows(r: int, t: int) -> int:
        return (r + t) % 3

    def body(rank: int) -> None:
        for dt in (DataType.FLOAT32, DataType.UINT8, DataType.BFLOAT16, DataType.INT64):
            x = data(rank, (rank + 1, 3), dt)
            got = value(enq(RequestType.ALLGATHER, [x], dt, name=f"ag.{dt.name}").wait(10))
            want = np.concatenate([data(r, (r + 1, 3), dt) for r in range(n)])
            assert np.array_equal(got, want), (got, want)
            same = data(rank, (2, 2), dt, 5)
            got = value(enq(RequestType.ALLGATHER, [same], dt, name=f"ag.eq.{dt.name}").wait(10))
            assert np.array_equal(got, np.concatenate([data(r, (2, 2), dt, 5)
                                                        for r in range(n)]))
            xs = [data(rank, (rows(rank, t), t + 1), dt, t) for t in range(4)]
            res = enq(RequestType.ALLGATHER, xs, dt, name=f"ag.g.{dt.name}").wait(10)
            for t in range(4):
                want = np.concatenate([data(r, (rows(r, t), t + 1), dt, t) for r in range(n)])
                assert np.array_equal(value(res[t]), want), (t, value(res[t]), want)
    run_loopback(n, body)


@case
def broadcast_roots(n: int) -> None:
    def body(rank: int) -> None:
        for root in range(n):
            x = data(rank, (7, 2), DataType.FLOAT64, root)
            got = value(enq(RequestType.BROADCAST, [x], DataType.FLOAT64, root=root,
                            name=f"bc.{root}").wait(10))
            assert np.array_equal(got, data(root, (7, 2), DataType.FLOAT64, root))
            y = data(rank, (3,), DataType.INT8, root)
            fa = FakeArray.of(y)
            collective.adapter.enqueue(RequestType.BROADCAST, [fa], device=0, dtypes=[DataType.INT8],
                               shapes=[(3,)], outputs=[fa], root=root,
                               name=f"bc_.{root}").wait(10)
            assert np.array_equal(fa.a, data(root, (3,), DataType.INT8, root))
    run_loopback(n, body)


@case
def alltoall_splits(n: int) -> None:
    def splits(r: int) -> list[int]:
        return [(r + d) % 3 for d in range(n)]

    def body(rank: int) -> None:
        sp = splits(rank)
        x = data(rank, (sum(sp) + 1, 2), DataType.INT32)
        res = enq(RequestType.ALLTOALL, [x], DataType.INT32, splits=np.array(sp, np.int32),
                  name="a2a").wait(10)
        out, recv = res.value()
        assert list(recv) == [splits(r)[rank] for r in range(n)], recv
        parts = []
        for r in range(n):
            xr = data(r, (sum(splits(r)) + 1, 2), DataType.INT32)
            start = sum(splits(r)[:rank])
            parts.append(xr[start:start + splits(r)[rank]])
        assert np.array_equal(out.get(), np.concatenate(parts))
    run_loopback(n, body)


@case
def reducescatter_even_uneven(n: int) -> None:
    def body(rank: int) -> None:
        for dt in (DataType.FLOAT32, DataType.BFLOAT16, DataType.INT64):
            for dim0 in (2 * n, 2 * n + 1, 1):
                for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
                    x = data(rank, (dim0, 3), dt, dim0)
                    got = value(enq(RequestType.REDUCESCATTER, [x], dt, op=op,
                                    name=f"rs.{dt.name}.{dim0}.{op.name}").wait(10))
                    full = reference([data(r, (dim0, 3), dt, dim0) for r in range(n)], dt, op)
                    rs = split_rows(dim0, n)
                    want = full[sum(rs[:rank]):sum(rs[:rank + 1])]
                    assert close(got, want, dt), (dt, dim0, op, got, want)
            xs = [data(rank, (d, 2), dt, d) for d in (n, n + 1, 2 * n - 1)]
            res = enq(RequestType.REDUCESCATTER, xs, dt, op=ReduceOp.SUM, prescale=2.0,
                      name=f"rs.g.{dt.name}").wait(10)
            for i, d in enumerate((n, n + 1, 2 * n - 1)):
                full = reference([data(r, (d, 2), dt, d) for r in range(n)], dt, ReduceOp.SUM,
                                 2.0)
                rs = split_rows(d, n)
                assert close(value(res[i]), full[sum(rs[:rank]):sum(rs[:rank + 1])], dt)
    run_loopback(n, body)


@case
def unsupported_dtype_fails_op_only(n: int) -> None:
    def body(rank: int) -> None:
        x = np.ones(4, np.int16)
        h = enq(RequestType.ALLREDUCE, [x], DataType.INT16, op=ReduceOp.SUM, name="i16")
        try:
            h.wait(10)
        except ValueError as exc:  # and a HorovodInternalError, as Horovod raises
            assert "int16" in str(exc), exc
            assert isinstance(exc, collective.HorovodInternalError), type(exc).__mro__
        else:
            raise AssertionError("int16 allreduce on GPU did not fail")
        y = np.ones(4, np.float32)
        got = value(enq(RequestType.ALLREDUCE, [y], DataType.FLOAT32, op=ReduceOp.SUM,
                        name="after").wait(10))
        assert np.array_equal(got, np.full(4, n, np.float32))
    run_loopback(n, body)


@case
def mixed_host_and_device(n: int) -> None:
    def body(rank: int) -> None:
        hs = [collective.allreduce_async(np.full(3, rank, np.float32), name=f"h{i}",
                                         op=ReduceOp.SUM) for i in range(3)]
        ds = [enq(RequestType.ALLREDUCE, [np.full(3, rank, np.float32)], DataType.FLOAT32,
                  op=ReduceOp.SUM, name=f"d{i}") for i in range(3)]
        want = np.full(3, sum(range(n)), np.float32)
        for h in hs:
            out = h.wait(10)
            assert isinstance(out, np.ndarray) and np.array_equal(out, want)
        for h in ds:
            assert np.array_equal(value(h.wait(10)), want)
    run_loopback(n, body)


@case
def synchronous_device_ops_take_the_express_lane(n: int) -> None:
    # After the first op (which binds the GPU on the coordinator thread), a lone cached
    # synchronous device op runs inside its own enqueue; the engine keeps few ops in flight
    # (finished ones are reaped every few launches) and reuses their completion events.
    from collective import _current as runtime
    from collective.engines.nccl import engine as engine_mod
    from collective.ops import wait_now

    def body(rank: int) -> None:
        rt = runtime.current()
        coord = rt.coordinator
        made = _fakecuda.calls.get("Event", 0)
        queried = _fakecuda.calls.get("eventQuery", 0)
        for i in range(30):
            x = np.full(6, float(rank + i), np.float32)
            res = wait_now(
                collective.synchronize,
                lambda: enq(RequestType.ALLREDUCE, [x], DataType.FLOAT32, op=ReduceOp.SUM,
                            name="lone", inplace=True))
            want = np.full(6, float(sum(range(n)) + n * i), np.float32)
            assert np.array_equal(value(res), want), (i, value(res), want)
        assert coord.express_rounds >= 28, coord.express_rounds  # the first binds the GPU
        eng = rt.member_sets()[0].device_engine
        assert len(eng._inflight) <= engine_mod._REAP_AT, len(eng._inflight)
        made = _fakecuda.calls.get("Event", 0) - made  # by every rank meanwhile
        assert made <= 4 * n, f"{made} completion events made for {30 * n} ops: not reused"
        # Reaping queries the newest in-flight event once every few ops, not once per op.
        queried = _fakecuda.calls.get("eventQuery", 0) - queried
        assert queried <= 30 * n // 2, f"{queried} event queries for {30 * n} lone ops"
    run_loopback(n, body)


@case
def express_ops_switch_streams_only_when_needed(n: int) -> None:
    # Express ops run on the caller's thread. A plain in-place sum launches no kernel and
    # leaves the thread's CuPy stream alone; scaled and out-of-place ops make the engine's
    # stream current for their kernels and allocations (the fake kernels assert it) and give
    # the caller's stream back. Ready events from the engine's pool are recycled once waited on.
    from collective import _current as runtime
    from collective.engines import device
    from collective.engines import nccl  # noqa: F401 - installs the ready-event pool
    from collective.ops import wait_now

    factor = {0: 1.0, 1: 0.5, 2: 2.0}

    def body(rank: int) -> None:
        coord = runtime.current().coordinator
        mine = _fakecuda.Stream(non_blocking=True).use()
        created = _fakecuda.calls.get("eventCreate", 0)
        for i in range(24):
            kind = i % 3
            x = np.full(5, float(rank + 1), np.float32)
            fa = FakeArray.of(x)
            ev = device.record_ready(0, mine.ptr)
            assert isinstance(ev, int)
            kw = {"op": ReduceOp.SUM, "name": f"variant{kind}"}
            if kind == 1:
                kw["postscale"] = 0.5
            elif kind == 2:
                kw["prescale"] = 2.0
            uses = _fakecuda.stream_uses()
            res = wait_now(collective.synchronize, lambda: collective.adapter.enqueue(
                RequestType.ALLREDUCE, [fa], device=0, dtypes=[DataType.FLOAT32],
                shapes=[x.shape], ready_events=[ev], outputs=None if kind == 1 else [fa], **kw))
            want = np.full(5, n * (n + 1) / 2 * factor[kind], np.float32)
            assert np.allclose(value(res), want), (i, value(res), want)
            assert _fakecuda.get_current_stream() is mine, "the caller's stream was not restored"
            if kind == 0 and i >= 3:  # express lane, no kernel: no stream switch either
                assert _fakecuda.stream_uses() == uses, "a plain op switched streams"
        assert coord.express_rounds >= 18, coord.express_rounds
        made = _fakecuda.calls.get("eventCreate", 0) - created  # by every rank meanwhile
        assert made <= 3 * n, f"{made} ready events made for {24 * n} ops: not recycled"
    run_loopback(n, body)


@case
def synchronous_ops_run_on_the_callers_stream(n: int) -> None:
    # A synchronous op with an OnStream marker (what the torch adapter's run_one passes) runs
    # on the caller's stream in the express lane: no ready event and no waits, one event
    # recorded after it. The communicator's ops never overlap: the first switch from the
    # engine's stream waits for its latest op, an op on the engine's stream afterwards waits
    # for the caller's event, and so does a caller's op after an engine op that failed before
    # its launch. Stream 0 (the legacy default stream) is a caller's stream like any other.
    # Ops the caller's stream cannot run (scaling kernels) get a ready event recorded on it.
    from collective import _current as runtime
    from collective import global_process_set
    from collective.engines import device
    from collective.engines.nccl import engine as engine_mod
    from collective.engines.nccl.events import _Completion, _StreamDone

    launched: dict[int, list[int]] = {}  # communicator rank -> streams of its allreduces
    inner = _fakecuda.NcclCommunicator.allReduce

    def spy(self, send, recv, count, dt, op, stream):
        launched.setdefault(self.rank, []).append(stream)
        return inner(self, send, recv, count, dt, op, stream)

    def sync(rank, stream, name, post=1.0):
        x = np.full(4, float(rank + 1), np.float32)
        marker = device.on_stream(0, stream)
        assert type(marker) is device.OnStream, marker
        res = collective.adapter.run_one(RequestType.ALLREDUCE, FakeArray.of(x), None, name,
                                         global_process_set, ReduceOp.SUM, 1.0, post, -1,
                                         DataType.FLOAT32, x.shape, 0, marker,
                                         lambda shape, like: _fakecuda.empty(shape, np.float32))
        want = np.full(4, n * (n + 1) / 2 * post, np.float32)
        assert np.array_equal(value(res), want), (name, value(res), want)
        return res

    def waited(stream, event, since):
        return (stream, event) in _fakecuda.wait_log[since:]

    def body(rank: int) -> None:
        rt = runtime.current()
        mine = _fakecuda.Stream(non_blocking=True).use()
        other = _fakecuda.Stream(non_blocking=True)
        streams = launched.setdefault(rank, [])
        sync(rank, mine.ptr, "first")  # binds the GPU on the coordinator thread
        eng = rt.member_sets()[0].device_engine
        for k, caller in enumerate((mine.ptr, 0)):
            name = f"lone{k}"  # names match across ranks; the streams do not
            sync(rank, caller, name)  # a new name: negotiated in full, on the engine's stream
            assert type(eng._last_done) is _Completion and eng._tail == eng._sp
            latest = eng._last_done.event.ptr
            for i in range(12):
                since = len(_fakecuda.wait_log)
                del streams[:]
                res = sync(rank, caller, name)
                assert streams == [caller], (i, streams, caller)
                assert type(res._done) is _StreamDone and res._done.event == eng._caller_done
                assert eng._caller_inflight, "the op's tensors were not kept until it ran"
                res.wait(caller, 0)  # the caller's own stream: nothing to wait for
                mine_waits = [w for w in _fakecuda.wait_log[since:]
                              if w[1] in (latest, eng._caller_done)]
                # The first waits for the engine stream's latest op, the others for nothing.
                assert mine_waits == ([(caller, latest)] if i == 0 else []), (i, mine_waits)
            assert eng._tail == caller
            # An op on the engine's stream waits for the caller's event first.
            since = len(_fakecuda.wait_log)
            y = np.full(3, float(rank), np.float32)
            collective.synchronize(enq(RequestType.ALLREDUCE, [y], DataType.FLOAT32,
                                       op=ReduceOp.SUM, name=f"async{k}", inplace=True))
            assert eng._tail == eng._sp
            assert waited(eng._sp, eng._caller_done, since), _fakecuda.wait_log[since:]
        # A cached scaled op (a kernel on the engine's stream): the engine records the ready
        # event on the caller's stream itself, and launches on its own.
        sync(rank, mine.ptr, "scaled", post=0.5)
        since = len(_fakecuda.record_log)
        del streams[:]
        res = sync(rank, mine.ptr, "scaled", post=0.5)
        assert streams == [eng._sp], streams
        assert type(res._done) is _Completion
        assert any(st == mine.ptr for _, st in _fakecuda.record_log[since:]), "no ready event"
        # An engine op that fails before its launch (no NCCL int16) after a caller's op: the
        # next caller's op on another stream still waits for the first one's event.
        for nm, st in (("a", mine.ptr), ("b", other.ptr), ("a", mine.ptr), ("b", other.ptr),
                       ("a", mine.ptr)):
            sync(rank, st, nm)
        assert eng._tail == mine.ptr
        bad = enq(RequestType.ALLREDUCE, [np.ones(3, np.int16)], DataType.INT16,
                  op=ReduceOp.SUM, name="bad", inplace=True)
        try:
            collective.synchronize(bad)
        except engine_mod.UnsupportedOnGPUError:
            pass
        else:
            raise AssertionError("an int16 allreduce on the fake GPU did not fail")
        since = len(_fakecuda.wait_log)
        sync(rank, other.ptr, "b")
        assert waited(other.ptr, eng._caller_done, since), _fakecuda.wait_log[since:]
        # Entries of caller-stream ops stay referenced until their event fired: a few at most.
        assert len(eng._caller_inflight) <= engine_mod._REAP_AT + 1, len(eng._caller_inflight)
        other_stream = _fakecuda.Stream(non_blocking=True)
        res.wait(other_stream.ptr, 0)
        res = sync(rank, mine.ptr, "a")
        res.synchronize()
        assert res.done()
        # With the switch off, synchronous ops get ready events as before; never a marker for
        # the per-thread default stream (another stream on each thread).
        assert device.on_stream(0, 2) is None
        device.CALLER_STREAM = False
        try:
            assert device.on_stream(0, mine.ptr) is None
        finally:
            device.CALLER_STREAM = True

    _fakecuda.NcclCommunicator.allReduce = spy
    try:
        run_loopback(n, body)
    finally:
        _fakecuda.NcclCommunicator.allReduce = inner


@case
def ready_events_of_failed_ops_return_to_the_pool(n: int) -> None:
    # Ops that fail in negotiation (a shape mismatch) never reach the engine, which otherwise
    # recycles their ready events: the coordinator gives them back, so a stream of failing
    # ops creates no new events.
    from collective.engines import device
    from collective.engines import nccl  # noqa: F401 - installs the ready-event pool

    def body(rank: int) -> None:
        mine = _fakecuda.Stream(non_blocking=True)
        warm = FakeArray.of(np.ones(3, np.float32))
        collective.adapter.enqueue(RequestType.ALLREDUCE, [warm], device=0, dtypes=[DataType.FLOAT32],
                           shapes=[(3,)], ready_events=[device.record_ready(0, mine.ptr)],
                           name="bind", op=ReduceOp.SUM).wait(10)
        created = _fakecuda.calls.get("eventCreate", 0)
        for i in range(20):
            shape = (4 + (rank if i % 2 else 0),)  # odd rounds: shapes differ across ranks
            fa = FakeArray.of(np.ones(shape, np.float32))
            h = collective.adapter.enqueue(RequestType.ALLREDUCE, [fa], device=0,
                                   dtypes=[DataType.FLOAT32], shapes=[shape],
                                   ready_events=[device.record_ready(0, mine.ptr)],
                                   name=f"maybe_bad{i % 2}", op=ReduceOp.SUM)
            try:
                h.wait(10)
                assert i % 2 == 0, "a shape mismatch did not fail"
            except collective.HorovodInternalError:
                assert i % 2 == 1
            # A grouped op, one event per member (as the torch adapter records them).
            fas = [FakeArray.of(np.ones(shape, np.float32)) for _ in range(2)]
            h = collective.adapter.enqueue(RequestType.ALLREDUCE, fas, device=0,
                                   dtypes=[DataType.FLOAT32] * 2, shapes=[shape] * 2,
                                   ready_events=[device.record_ready(0, mine.ptr)
                                                 for _ in fas],
                                   grouped=True, name=f"maybe_bad_group{i % 2}",
                                   op=ReduceOp.SUM)
            try:
                h.wait(10)
                assert i % 2 == 0, "a shape mismatch did not fail"
            except collective.HorovodInternalError:
                assert i % 2 == 1
        made = _fakecuda.calls.get("eventCreate", 0) - created  # by every rank meanwhile
        assert made <= 3 * n, f"{made} ready events made for {60 * n} ops: failed ops leak"
    run_loopback(n, body)


@case
def tensors_on_a_device_that_is_not_current(n: int) -> None:
    # Rank r places its tensors on device r but never makes it current (its threads stay on
    # device 0), as a script that uses `t.cuda(hvd.local_rank())` without `set_device`. Ready
    # events are recorded on device r's default stream (handle 0), the engine binds to device
    # r, the caller's default stream of device r waits for the result, and the user thread's
    # current device stays 0. The fake fails a record or launch on the wrong device as CUDA
    # does (cudaErrorInvalidResourceHandle).
    from collective.engines import device
    from collective.ops import wait_now

    def body(rank: int) -> None:
        assert _fakecuda._current_device() == 0
        for i in range(6):
            x = FakeArray.of(np.full(5, float(rank + i), np.float32))
            ev = device.record_ready(rank, 0)  # the default stream of the tensor's device
            assert _fakecuda._current_device() == 0
            kw = dict(device=rank, dtypes=[DataType.FLOAT32], shapes=[(5,)], ready_events=[ev],
                      op=ReduceOp.SUM, name="offdev", prescale=0.5 if i % 2 else 1.0)
            if i < 3:
                res = collective.adapter.enqueue(RequestType.ALLREDUCE, [x], **kw).wait(10)
            else:  # synchronous: the express lane runs the engine on this thread
                res = wait_now(collective.synchronize,
                               lambda: collective.adapter.enqueue(RequestType.ALLREDUCE, [x], **kw))
            assert _fakecuda._current_device() == 0, "an op left another device current"
            del _fakecuda.waits()[:]
            res.wait(0, rank)  # the caller's default stream of device `rank`
            assert _fakecuda.waits()[-1] == (0, rank), _fakecuda.waits()
            assert _fakecuda._current_device() == 0
            want = sum(r + i for r in range(n)) * (0.5 if i % 2 else 1.0)
            assert np.array_equal(value(res), np.full(5, want, np.float32)), value(res)
        eng = collective._current.current().member_sets()[0].device_engine
        assert eng.device == rank
    run_loopback(n, body)


@case
def an_op_on_a_second_device_names_both_devices(n: int) -> None:
    # After the communicator was bound to device r, an op whose tensor is on device r + n
    # fails with an error naming both devices (never a CUDA error), on every rank here since
    # every rank does it; the runtime then shuts down (a peer may have launched its half).
    def body(rank: int) -> None:
        kw = dict(dtypes=[DataType.FLOAT32], shapes=[(3,)], op=ReduceOp.SUM)
        x = FakeArray.of(np.ones(3, np.float32))
        res = collective.adapter.enqueue(RequestType.ALLREDUCE, [x], device=rank, name="first",
                                 **kw).wait(10)
        assert np.array_equal(value(res), np.full(3, n, np.float32))
        other = rank + n
        try:
            collective.adapter.enqueue(RequestType.ALLREDUCE, [FakeArray.of(np.ones(3, np.float32))],
                               device=other, name="second", **kw).wait(10)
        except collective.HorovodInternalError as exc:
            # This rank's own error, or the first failing peer's (which aborted the group).
            text = str(exc)
            assert "is on cuda:" in text and "is bound to cuda:" in text, text
            assert "InvalidResourceHandle" not in text, text
        else:
            raise AssertionError("an op on a second device did not fail")
    run_loopback(n, body)


@case
def large_async_ops_start_on_the_callers_thread(n: int) -> None:
    # A user's async device allreduce of EAGER_BYTES or more (`enqueue(eager=True)`) is
    # negotiated and launched inside its enqueue (the express lane, else a driven cycle);
    # smaller ones and gradient hooks' ops (eager=False) go to the coordinator thread. Ranks
    # that start the large ops in different orders fall back to ordinary rounds: every result
    # arrives, none hangs.
    from collective import _current as runtime
    from collective import ops as ops_mod

    big = ops_mod.EAGER_BYTES // 4  # float32 elements of the smallest eager op

    def body(rank: int) -> None:
        coord = runtime.current().coordinator
        enq(RequestType.ALLREDUCE, [np.ones(4, np.float32)], DataType.FLOAT32,
            name="bind").wait(10)  # the first device op binds the GPU on the coordinator thread
        names = [f"big{i}" for i in range(4)]

        def block(order: list[str], eager: bool, length: int) -> None:
            hs = {nm: enq(RequestType.ALLREDUCE,
                          [np.full(length, float(rank + i), np.float32)], DataType.FLOAT32,
                          op=ReduceOp.SUM, name=nm + str(length), eager=eager)
                  for i, nm in sorted(enumerate(names), key=lambda p: order.index(p[1]))}
            for i, nm in enumerate(names):
                want = float(sum(range(n)) + n * i)
                got = value(hs[nm].wait(10))
                assert got.shape == (length,) and np.all(got == want), (nm, got[:3], want)

        for _ in range(3):  # the first block fills the response cache
            block(names, True, big)
        before = coord.express_rounds
        for _ in range(3):
            block(names, True, big)
        ran_here = coord.express_rounds - before
        assert ran_here >= 1, "no large async op was negotiated on the caller's thread"
        before = coord.express_rounds
        for _ in range(2):
            block(names, False, big)  # a gradient hook's op
            block(names, True, big // 2)  # below EAGER_BYTES
        assert coord.express_rounds == before, coord.express_rounds - before
        for _ in range(3):  # opposite orders on odd and even ranks
            block(names if rank % 2 == 0 else names[::-1], True, big)
    run_loopback(n, body, timeout=60)


@case
def large_async_ops_wait_for_a_late_peer_once(n: int) -> None:
    # Rank 0 starts many large async ops while its peers are late (busy elsewhere): its first
    # call meets their next round and the op then waits; every later call goes to the
    # coordinator thread at once instead of running a cycle that waits for the late peers'
    # next round again (one such wait per call would add up over a loop of calls).
    import time

    from collective import _current as runtime
    from collective import ops as ops_mod

    big = ops_mod.EAGER_BYTES // 4
    k = 12

    def body(rank: int) -> None:
        coord = runtime.current().coordinator
        enq(RequestType.ALLREDUCE, [np.ones(4, np.float32)], DataType.FLOAT32,
            name="bind").wait(10)
        driven = []
        drive = coord.drive
        coord.drive = lambda: (driven.append(1), drive())[1]

        def block() -> None:
            hs = [enq(RequestType.ALLREDUCE, [np.full(big, float(rank + i), np.float32)],
                      DataType.FLOAT32, op=ReduceOp.SUM, name=f"late{i}", eager=True)
                  for i in range(k)]
            for i, h in enumerate(hs):
                got = value(h.wait(30))
                assert np.all(got == float(sum(range(n)) + n * i)), (i, got[:3])

        block()  # the response cache learns the names
        enq(RequestType.ALLREDUCE, [np.ones(4, np.float32)], DataType.FLOAT32,
            name="sync").wait(10)
        if rank != 0:
            time.sleep(1.0)
        driven.clear()
        block()
        if rank == 0:
            assert len(driven) <= 1, f"{len(driven)} of {k} calls ran a cycle on the caller"
    run_loopback(n, body, timeout=60)


def main() -> int:
    passed = failed = 0
    for n in (2, 3):
        for fn in CASES:
            try:
                fn(n)
                passed += 1
                print(f"PASS {fn.__name__} n={n}", flush=True)
            except BaseException:  # noqa: BLE001 - reported
                failed += 1
                print(f"FAIL {fn.__name__} n={n}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
