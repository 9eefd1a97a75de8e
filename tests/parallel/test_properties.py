"""Property tests: every collective against a numpy reference over random shapes, dtypes, ops,
scale factors, roots, alltoall splits and process sets, under real ranks.

Every rank draws the SAME examples: the `ringvod` hypothesis profile (tests/conftest.py) is
derandomized, has no database and no shrinking. Rank r's data is `rank_data(seed, r, ...)`, so
each rank can compute all inputs and the reference. `agree()` makes every rank pass or fail each
example together, so the ranks never drift apart.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import collective as hvd
from tests._spmd import spmd_driver
from tests.parallel._util import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, agree, assert_close,
                                  env_size, rank_data, reference_reduce)

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(240)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=240)

N = env_size()
# Static process sets besides the global one (a set equal to all ranks is allowed too).
_SETS = {1: [], 2: [[0], [1], [0, 1]], 4: [[0, 2], [1, 3], [1, 2, 3], [3]]}
SETS = [hvd.ProcessSet(r) for r in _SETS.get(N, [list(range(0, N, 2))])]
NUMERIC = INT_DTYPES + FLOAT_DTYPES

_counter = [0]


def fresh(prefix: str) -> str:
    """A name unique per example and identical on every rank (same draws, same order)."""
    _counter[0] += 1
    return f"{prefix}.{_counter[0]}"


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init(process_sets=SETS)
    yield
    hvd.shutdown()


process_sets = st.sampled_from([hvd.global_process_set] + SETS)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)
factors = st.sampled_from([1.0, 1.0, 0.5, 2.0, 3.0, 0.25])


def ps_ranks(ps) -> list[int]:
    return list(range(N)) if ps is hvd.global_process_set else list(ps.ranks)


def member(ps) -> bool:
    return hvd.rank() in ps_ranks(ps)


@given(dtype=st.sampled_from(ALL_DTYPES), op=st.sampled_from(
    [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]), shape=shapes, seed=seeds,
    pre=factors, post=factors, ps=process_sets, reuse=st.booleans())
def test_allreduce_matches_numpy(dtype, op, shape, seed, pre, post, ps, reuse):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        pre = post = 1.0  # scaling a bool is meaningless; bool reduces as logical or/and
        if op == hvd.Average:
            op = hvd.Sum
    name = f"prop.ar.{dt.name}.{len(shape)}" if reuse else fresh("prop.ar")

    def body():
        if not member(ps):
            return
        ranks = ps_ranks(ps)
        parts = [rank_data(seed, r, shape, dt) for r in ranks]
        got = hvd.allreduce(parts[ranks.index(hvd.rank())], op=op, prescale_factor=pre,
                            postscale_factor=post, process_set=ps, name=name)
        assert_close(got, reference_reduce(parts, op, pre, post),
                     f"allreduce {dt.name} op={op} shape={shape} pre={pre} post={post} "
                     f"ranks={ranks}")

    agree(body, "allreduce")


@given(dtypes=st.lists(st.sampled_from(NUMERIC), min_size=1, max_size=6), seed=seeds,
       op=st.sampled_from([hvd.Sum, hvd.Average, hvd.Max]), ps=process_sets,
       inplace=st.booleans())
def test_grouped_allreduce_matches_numpy(dtypes, seed, op, ps, inplace):
    name = fresh("prop.gar")

    def body():
        if not member(ps):
            return
        ranks = ps_ranks(ps)
        me = ranks.index(hvd.rank())
        parts = [[rank_data(seed + i, r, (i + 1, 2), d) for r in ranks]
                 for i, d in enumerate(dtypes)]
        mine = [p[me].copy() for p in parts]
        fn = hvd.grouped_allreduce_ if inplace else hvd.grouped_allreduce
        outs = fn(mine, op=op, process_set=ps, name=name)
        for i, (o, p) in enumerate(zip(outs, parts)):
            assert_close(o, reference_reduce(p, op), f"member {i} dtype {np.dtype(dtypes[i])}")

    agree(body, "grouped allreduce")


@given(dtype=st.sampled_from(ALL_DTYPES), data=st.data(), seed=seeds, ps=process_sets)
def test_allgather_matches_numpy(dtype, data, seed, ps):
    rows = data.draw(st.lists(st.integers(0, 4), min_size=N, max_size=N), label="rows")
    trailing = data.draw(st.lists(st.integers(1, 3), max_size=2).map(tuple), label="trailing")
    name = fresh("prop.ag")

    def body():
        if not member(ps):
            return
        ranks = ps_ranks(ps)
        parts = [rank_data(seed, r, (rows[r],) + trailing, dtype) for r in ranks]
        got = hvd.allgather(parts[ranks.index(hvd.rank())], process_set=ps, name=name)
        assert_close(got, np.concatenate(parts), f"allgather rows={rows} ranks={ranks}")

    agree(body, "allgather")


@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, seed=seeds, ps=process_sets,
       data=st.data(), inplace=st.booleans())
def test_broadcast_matches_numpy(dtype, shape, seed, ps, data, inplace):
    root = data.draw(st.sampled_from(ps_ranks(ps)), label="root")
    name = fresh("prop.bc")

    def body():
        if not member(ps):
            return
        x = rank_data(seed, hvd.rank(), shape, dtype)
        if inplace:
            hvd.broadcast_(x, root_rank=root, process_set=ps, name=name)
            got = x
        else:
            got = hvd.broadcast(x, root_rank=root, process_set=ps, name=name)
        assert_close(got, rank_data(seed, root, shape, dtype), f"broadcast root={root}")

    agree(body, "broadcast")


@given(dtype=st.sampled_from(ALL_DTYPES), seed=seeds, ps=process_sets, data=st.data())
def test_alltoall_matches_numpy(dtype, seed, ps, data):
    k = len(ps_ranks(ps))
    splits = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=k, max_size=k),
                                min_size=k, max_size=k), label="splits")
    trailing = data.draw(st.lists(st.integers(1, 3), max_size=2).map(tuple), label="trailing")
    name = fresh("prop.a2a")

    def body():
        if not member(ps):
            return
        ranks = ps_ranks(ps)
        me = ranks.index(hvd.rank())
        parts = [rank_data(seed, r, (sum(splits[i]),) + trailing, dtype)
                 for i, r in enumerate(ranks)]
        out, recv = hvd.alltoall(parts[me], splits=np.array(splits[me], dtype=np.int32),
                                 process_set=ps, name=name)
        np.testing.assert_array_equal(recv, [splits[s][me] for s in range(k)])
        want = []
        for s in range(k):
            start = sum(splits[s][:me])
            want.append(parts[s][start:start + splits[s][me]])
        assert_close(out, np.concatenate(want), f"alltoall splits={splits}")

    agree(body, "alltoall")


@given(dtype=st.sampled_from(NUMERIC), op=st.sampled_from([hvd.Sum, hvd.Average]),
       seed=seeds, ps=process_sets, dim0=st.integers(0, 9),
       trailing=st.lists(st.integers(1, 3), max_size=2).map(tuple), pre=factors, post=factors)
def test_reducescatter_matches_numpy(dtype, op, seed, ps, dim0, trailing, pre, post):
    name = fresh("prop.rs")

    def body():
        if not member(ps):
            return
        ranks = ps_ranks(ps)
        k, me = len(ranks), ranks.index(hvd.rank())
        parts = [rank_data(seed, r, (dim0,) + trailing, dtype) for r in ranks]
        got = hvd.reducescatter(parts[me], op=op, process_set=ps, name=name,
                                prescale_factor=pre, postscale_factor=post)
        full = reference_reduce(parts, op, pre, post)
        counts = [dim0 // k + (1 if r < dim0 % k else 0) for r in range(k)]
        start = sum(counts[:me])
        assert_close(got, full[start:start + counts[me]],
                     f"reducescatter dim0={dim0} op={op} ranks={ranks}")

    agree(body, "reducescatter")


@settings(max_examples=10)
@given(seed=seeds, n=st.integers(1, 40), data=st.data())
def test_async_burst_with_mixed_ops(seed, n, data):
    """A burst of async ops of different kinds and dtypes, waited in reverse order."""
    kinds = data.draw(st.lists(st.sampled_from(["ar", "ag", "bc"]), min_size=n, max_size=n))
    dts = data.draw(st.lists(st.sampled_from([np.float32, np.float16, np.int64]),
                             min_size=n, max_size=n))
    base = fresh("prop.burst")

    def body():
        me = hvd.rank()
        handles = []
        for i, (kind, dt) in enumerate(zip(kinds, dts)):
            x = rank_data(seed + i, me, (i % 7 + 1,), dt)
            name = f"{base}.{i}"
            if kind == "ar":
                handles.append((i, kind, dt, hvd.allreduce_async(x, op=hvd.Sum, name=name)))
            elif kind == "ag":
                handles.append((i, kind, dt, hvd.allgather_async(x, name=name)))
            else:
                handles.append((i, kind, dt, hvd.broadcast_async(x, root_rank=i % N,
                                                                 name=name)))
        for i, kind, dt, h in reversed(handles):
            got = h.wait(60)
            parts = [rank_data(seed + i, r, (i % 7 + 1,), dt) for r in range(N)]
            want = {"ar": lambda: reference_reduce(parts, hvd.Sum),
                    "ag": lambda: np.concatenate(parts),
                    "bc": lambda: parts[i % N]}[kind]()
            assert_close(got, want, f"burst op {i} ({kind}, {np.dtype(dt).name})")

    agree(body, "async burst")
