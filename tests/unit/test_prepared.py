"""`collective.ops.prepare`: an op checked once and submitted again and again (a gradient's
allreduce in per-gradient mode), on loopback runtimes (threads as ranks)."""
from __future__ import annotations

import numpy as np
import pytest

import collective
from collective import DataType, ReduceOp, RequestType, adapter
from collective.errors import DuplicateNameError
from tests._spmd import run_loopback

pytestmark = pytest.mark.timeout(60)


def test_prepared_allreduce_matches_enqueue_step_after_step():
    def body(rank: int) -> list[float]:
        op = adapter.prepare(RequestType.ALLREDUCE, "grad.w", DataType.FLOAT32, (4,),
                             op=ReduceOp.AVERAGE, prescale=2.0, postscale=0.5)
        assert op.name == "allreduce.grad.w"
        out = []
        for step in range(5):
            x = np.full(4, float(rank + step), dtype=np.float32)
            h = op.submit(x, x)  # in place
            assert h.wait(10) is x or np.shares_memory(h.wait(10), x)
            ref = np.full(4, float(rank + step), dtype=np.float32)
            ref = collective.allreduce(ref, name=f"ref.{step}", op=ReduceOp.AVERAGE,
                                       prescale_factor=2.0, postscale_factor=0.5)
            np.testing.assert_array_equal(x, ref)
            out.append(float(x[0]))
        return out

    res = run_loopback(3, body)
    assert res[0] == res[1] == res[2] == [1.0 + s for s in range(5)]


def test_prepared_ops_fuse_with_each_other():
    def body(rank: int) -> None:
        ops = [adapter.prepare(RequestType.ALLREDUCE, f"g{i}", DataType.FLOAT64, (3,),
                               op=ReduceOp.SUM) for i in range(8)]
        for _ in range(3):
            xs = [np.full(3, float(rank * 10 + i)) for i in range(8)]
            hs = [op.submit(x, x) for op, x in zip(ops, xs)]
            for i, h in enumerate(hs):
                h.wait(10)
                np.testing.assert_array_equal(xs[i], np.full(3, float(10 + 2 * i)))

    run_loopback(2, body)


def test_prepared_op_pending_twice_is_a_duplicate_name():
    def body(rank: int) -> None:
        op = adapter.prepare(RequestType.ALLREDUCE, "dup", DataType.FLOAT32, (2,))
        x = np.ones(2, dtype=np.float32)
        h = op.submit(x, x)
        if rank == 0:
            with pytest.raises(DuplicateNameError, match="allreduce.dup"):
                op.submit(x.copy(), None)
        h.wait(10)

    run_loopback(2, body)


def test_prepare_checks_once_and_refuses_other_op_types():
    def body(rank: int) -> None:
        with pytest.raises(ValueError, match="not supported|bool"):
            adapter.prepare(RequestType.ALLREDUCE, "b", DataType.BOOL, (2,),
                            op=ReduceOp.AVERAGE)
        with pytest.raises(ValueError, match="BROADCAST"):
            adapter.prepare(RequestType.BROADCAST, "b", DataType.FLOAT32, (2,))

    run_loopback(2, body)


def test_prepared_op_follows_a_new_runtime():
    # After the runtime it was prepared on shut down (an elastic reset, a re-init), the next
    # submit binds to the current one.
    prepared: list = [None, None]

    def first(rank: int) -> None:
        prepared[rank] = adapter.prepare(RequestType.ALLREDUCE, "again", DataType.FLOAT32,
                                         (2,), op=ReduceOp.SUM)
        x = np.ones(2, dtype=np.float32)
        prepared[rank].submit(x, x).wait(10)

    def second(rank: int) -> None:
        x = np.full(2, 2.0, dtype=np.float32)
        prepared[rank].submit(x, x).wait(10)
        np.testing.assert_array_equal(x, [4.0, 4.0])

    run_loopback(2, first)
    run_loopback(2, second)


def test_prepare_before_init_raises():
    with pytest.raises(collective.NotInitializedError):
        adapter.prepare(RequestType.ALLREDUCE, "x", DataType.FLOAT32, (1,))
