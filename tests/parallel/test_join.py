"""`join` under real ranks: uneven work, zeros from joined ranks, Average over the full size,
the last joined rank everywhere, with the tensors cached and not cached.

Also run with HOROVOD_CACHE_CAPACITY=0 (second driver) so the no-cache path is covered too.
"""
from __future__ import annotations

import numpy as np
import pytest

import collective as hvd
from tests._spmd import spmd_driver
from tests.parallel._util import within

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(90)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=120)
test_spmd_nocache = spmd_driver(__file__, nps=(2,), timeout=120,
                                env={"HOROVOD_CACHE_CAPACITY": "0"})


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def uneven_steps(name: str, op: int) -> int:
    """Rank r runs r + 1 steps of an allreduce, then joins. Returns join()'s value."""
    n, me = hvd.size(), hvd.rank()
    for step in range(me + 1):
        x = np.full(6, me + 1.0, dtype=np.float32)
        got = hvd.allreduce(x, op=op, name=name)
        active = [r for r in range(n) if r >= step]  # ranks with more than `step` steps
        total = float(sum(r + 1 for r in active))
        want = total / n if op == hvd.Average else total  # Average divides by the FULL size
        np.testing.assert_allclose(got, np.full(6, want), err_msg=f"step {step} of {name}")
    return hvd.join()


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["sum", "average"])
def test_join_uneven_uncached_then_cached(op):
    # First round: the name is new (slow path); second round: it is in the response cache.
    for rnd in range(2):
        last = uneven_steps(f"join.{int(op)}", op)
        assert last == hvd.size() - 1, f"round {rnd}: join returned {last}"


def test_join_returns_same_last_rank_everywhere():
    last = hvd.join()
    everyone = hvd.allgather(np.array([last], dtype=np.int64), name="join.last")
    assert len(set(everyone.tolist())) == 1
    assert 0 <= last < hvd.size()


def test_join_with_grouped_and_min_max():
    n, me = hvd.size(), hvd.rank()
    if me < n - 1:
        hvd.join()
        return
    # The last rank reduces alone; the joined ranks contribute zeros.
    outs = hvd.grouped_allreduce([np.full(3, 5.0), np.full(2, -5.0)], op=hvd.Sum, name="jg")
    np.testing.assert_allclose(outs[0], np.full(3, 5.0))
    np.testing.assert_allclose(outs[1], np.full(2, -5.0))
    mx = hvd.allreduce(np.full(3, -5.0), op=hvd.Max, name="jmax")
    np.testing.assert_allclose(mx, np.full(3, 0.0 if n > 1 else -5.0))
    assert hvd.join() == n - 1


def test_ops_without_join_support_fail_while_a_rank_is_joined():
    n, me = hvd.size(), hvd.rank()
    if n == 1:
        assert hvd.join() == 0
        return
    if me == 0:
        assert hvd.join() == n - 1
        return
    for fn, pattern in [
        (lambda: hvd.allgather(np.ones((1, 2)), name="jag"),
         r"^Allgather is not supported with Join at this time\."),
        (lambda: hvd.broadcast(np.ones(2), root_rank=1, name="jbc"),
         r"^Broadcast is not supported with Join at this time\."),
        (lambda: hvd.alltoall(np.ones((n, 1)), name="ja2a"),
         r"^Alltoall is not supported with Join at this time\."),
        (lambda: hvd.reducescatter(np.ones((n, 1)), op=hvd.Sum, name="jrs"),
         r"^Reducescatter is not supported with Join at this time\."),
    ]:
        with within(2.0, pattern):
            with pytest.raises(hvd.HorovodInternalError, match=pattern):
                fn()
    assert hvd.join() == n - 1


def test_everyone_healthy_after_joins():
    np.testing.assert_allclose(hvd.allreduce(np.ones(4), op=hvd.Sum, name="post.join"),
                               np.full(4, hvd.size()))
    np.testing.assert_allclose(hvd.allgather(np.ones((1, 2)), name="post.join.ag"),
                               np.ones((hvd.size(), 2)))
