"""Cross-rank disagreements fail on EVERY rank within a second; local misuse raises ValueError.

Each mismatch test makes ranks disagree about one property of the same tensor name; the
coordinator of the process set turns it into an ERROR response delivered to every rank's handle
(Horovod's texts). At np=1 there is nobody to disagree with: those tests only check that the
same calls succeed.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import collective as hvd
from collective.entry import Entry
from collective.handle import Handle
from collective._current import current
from collective.types import Request, RequestType, dtype_of
from tests._spmd import spmd_driver
from tests.parallel._util import within

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(90)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=120)

FAST = 1.0  # seconds: a mismatch must be reported this fast on every rank


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def expect_mismatch(fn, pattern: str, name: str) -> None:
    """Calls fn on every rank; every rank must raise MismatchError (a HorovodInternalError)
    matching pattern."""
    hvd.barrier()
    if hvd.size() == 1:
        fn()  # nothing to disagree with
        return
    with within(FAST, f"mismatch error for {name} on rank {hvd.rank()}"):
        with pytest.raises(hvd.MismatchError) as info:
            fn()
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert re.search(pattern, msg), f"{msg!r} does not match {pattern!r}"
    assert name in msg, f"the error does not name the tensor {name!r}: {msg}"
    # The runtime is still healthy afterwards.
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after." + name),
                               np.full(2, hvd.size()))


def test_mismatched_shape():
    x = np.ones(hvd.rank() + 1, dtype=np.float32)
    expect_mismatch(lambda: hvd.allreduce(x, name="shape"),
                    r"^Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape "
                    r"\[\d+\], but another rank sent a tensor of shape \[\d+\]\.", "shape")


def test_mismatched_dtype():
    x = np.ones(4, dtype=np.float32 if hvd.rank() == 0 else np.float64)
    expect_mismatch(lambda: hvd.allreduce(x, name="dtype"),
                    r"^Mismatched data types: One rank had type float(32|64), but another rank "
                    r"had type float(32|64)\.", "dtype")


def test_mismatched_reduce_op():
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    expect_mismatch(lambda: hvd.allreduce(np.ones(3), op=op, name="redop"),
                    r"^Mismatched reduction operation: One rank sent reduction op [14], but "
                    r"another rank sent reduction op [14]\.", "redop")


def test_mismatched_scale_factors():
    pre = 1.0 if hvd.rank() == 0 else 2.0
    expect_mismatch(lambda: hvd.allreduce(np.ones(3), op=hvd.Sum, prescale_factor=pre,
                                          name="scale"),
                    r"^Mismatched prescale and/or postscale factors: One rank sent factors "
                    r"\([12]\.0, 1\.0\), but another rank sent factors \([12]\.0, 1\.0\)\.",
                    "scale")
    post = 1.0 if hvd.rank() == 0 else 0.5
    expect_mismatch(lambda: hvd.allreduce(np.ones(3), op=hvd.Sum, postscale_factor=post,
                                          name="postscale"),
                    r"^Mismatched prescale and/or postscale factors", "postscale")


def test_mismatched_broadcast_root():
    root = 0 if hvd.rank() == 0 else hvd.size() - 1
    expect_mismatch(lambda: hvd.broadcast(np.ones(2), root_rank=root, name="root"),
                    r"^Mismatched BROADCAST root ranks: One rank specified root rank \d+, but "
                    r"another rank specified root rank \d+\.", "root")


def test_mismatched_broadcast_shape():
    expect_mismatch(lambda: hvd.broadcast(np.ones((2, hvd.rank() + 1)), root_rank=0,
                                          name="bshape"),
                    r"^Mismatched BROADCAST tensor shapes", "bshape")


def test_mismatched_allgather_ndim_and_dims():
    x = np.ones((2,) * (1 + min(hvd.rank(), 1)))
    expect_mismatch(lambda: hvd.allgather(x, name="agrank"),
                    r"^Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank [12], "
                    r"but another rank sent a tensor of rank [12]\.", "agrank")
    y = np.ones((1, hvd.rank() + 2))
    expect_mismatch(lambda: hvd.allgather(y, name="agdim"),
                    r"^Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 "
                    r"equal to \d+, but another rank sent a tensor with dimension 1 equal to \d+\.",
                    "agdim")


def test_mismatch_of_a_name_at_the_wire_limit():
    # The longest name the wire carries (1 MiB with its "allreduce." prefix): the mismatch text
    # quotes its start and its length, so it reaches every rank as a mismatch error instead of
    # a text over the wire's limit ending the job (ShutdownError).
    name = "n" * ((1 << 20) - len("allreduce."))
    x = np.ones(hvd.rank() + 1, dtype=np.float32)
    expect_mismatch(lambda: hvd.allreduce(x, name=name),
                    r"^Mismatched ALLREDUCE tensor shapes: .* \(tensor 'allreduce\.n{190}'\.\.\. "
                    r"\(1048576 bytes\): rank\(s\) ", "allreduce." + "n" * 100)


def test_scalar_allgather_is_an_error_on_every_rank():
    hvd.barrier()
    with within(FAST, "scalar allgather error"):
        with pytest.raises(hvd.HorovodInternalError,
                           match=r"^Process-set rank zero tried to ALLGATHER a rank-zero tensor"):
            hvd.allgather(np.float32(1.0), name="ag0d")


def test_mismatched_operation_type():
    # The public API prefixes names by op, so only an adapter can send two op types under one
    # name; submit through the runtime like an adapter would.
    kind = RequestType.ALLREDUCE if hvd.rank() == 0 else RequestType.ALLGATHER
    x = np.ones(2, dtype=np.float32)

    def submit():
        rt = current()
        state = rt.process_set_state(hvd.global_process_set, "Allreduce")
        req = Request(rank=state.rank, type=kind, name="optype", dtype=dtype_of(x),
                      shape=x.shape)
        e = Entry(req, x, Handle("optype"))
        rt.submit(state, [e])
        return e.handle.wait(30)

    expect_mismatch(submit, r"^Mismatched operations: One rank did an (ALLREDUCE|ALLGATHER), "
                            r"but another rank did an (ALLREDUCE|ALLGATHER)\.", "optype")


def test_mismatch_inside_group_fails_the_group_on_every_rank():
    ts = [np.ones(3), np.ones(hvd.rank() + 1)]
    expect_mismatch(lambda: hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp"),
                    r"Mismatched ALLREDUCE tensor shapes", "grp")


def test_mismatched_group_sizes_fail_the_group_on_every_rank():
    # Ranks that pass a grouped op different numbers of tensors submit member names no other
    # rank does (grpsize_1of1 against grpsize_1of2, grpsize_2of2): an error, not a stall.
    ts = [np.ones(3) for _ in range(1 + hvd.rank() % 2)]
    expect_mismatch(lambda: hvd.grouped_allreduce(ts, op=hvd.Sum, name="grpsize"),
                    r"^Mismatched grouped allreduce sizes: rank\(s\) [0-9, ]+ passed 1 tensor; "
                    r"rank\(s\) [0-9, ]+ passed 2 tensors", "grpsize")


def test_duplicate_name_raises_at_enqueue():
    h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="dup")
    with pytest.raises(ValueError) as info:
        hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="dup")
    assert isinstance(info.value, hvd.DuplicateNameError)
    assert "allreduce.dup" in str(info.value)
    np.testing.assert_allclose(h.wait(30), np.full(2, hvd.size()))
    # Once the first completed, the name is free again.
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="dup"),
                               np.full(2, hvd.size()))
    # A grouped op whose member collides with a pending name is rejected as a whole.
    h = hvd.grouped_allreduce_async([np.ones(1), np.ones(1)], op=hvd.Sum, name="gdup")
    with pytest.raises(ValueError, match="gdup_1of2"):
        hvd.grouped_allreduce_async([np.ones(1), np.ones(1)], op=hvd.Sum, name="gdup")
    for out in h.wait(30):
        np.testing.assert_allclose(out, np.full(1, hvd.size()))


def test_alltoall_splits_are_whole_row_counts():
    """Splits are never truncated: a non-integral value fails at the call on the rank that
    gave it, naming the tensor, the rank and the values; whole floats (2.0) are row counts."""
    n, me = hvd.size(), hvd.rank()
    x = np.arange(2 * n, dtype=np.float32).reshape(2 * n, 1)
    for bad in ([1.5] + [0.5] * (n - 1), np.array([0.5] * n), [float("nan")] * n,
                np.array([2 ** 31 + 0.0] * n)):
        with pytest.raises(ValueError) as info:
            hvd.alltoall(x, splits=bad, name="a2a.float")
        msg = str(info.value)
        assert msg.startswith("alltoall expects splits to contain 32-bit integer elements")
        for part in ("'alltoall.a2a.float'", f"rank {me}", "whole", "2.0"):
            assert part in msg, (part, msg)
    assert "1.5" in _msg(lambda: hvd.alltoall(x, splits=[1.5] + [0.5] * (n - 1), name="a2a.f"))
    # Integral floats and wide integers are row counts, taken exactly.
    for i, good in enumerate(([2.0] * n, np.full(n, 2, dtype=np.int64),
                              np.full(n, 2.0, dtype=np.float16))):
        out, recv = hvd.alltoall(x, splits=good, name=f"a2a.whole.{i}")
        assert recv.tolist() == [2] * n
        np.testing.assert_array_equal(out[:, 0], [2 * me, 2 * me + 1] * n)  # same x everywhere
    # A value too wide for int32 is not wrapped round to a small count.
    with pytest.raises(ValueError, match=r"^Sum of splits entries is greater"):
        hvd.alltoall(x, splits=np.array([2 ** 32 + 1] + [0] * (n - 1)), name="a2a.wide")


def _msg(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_local_argument_errors_are_value_errors():
    n = hvd.size()
    with pytest.raises(ValueError, match=r"^broadcast received invalid root rank"):
        hvd.broadcast(np.ones(1), root_rank=n, name="badroot")
    with pytest.raises(ValueError, match=r"^alltoall expects a 1D splits tensor"):
        hvd.alltoall(np.ones((n, 1)), splits=np.ones((1, n), dtype=np.int32), name="a1")
    with pytest.raises(ValueError, match=r"^alltoall expects splits to contain 32-bit integer"):
        hvd.alltoall(np.ones((n, 1)), splits=np.full(n, 0.5, dtype=np.float32), name="a2")
    with pytest.raises(ValueError, match=r"^alltoall expects splits to contain 32-bit integer"):
        hvd.alltoall(np.ones((n, 1)), splits=np.array([True] * n), name="a2b")
    with pytest.raises(ValueError, match=r"^Sum of splits entries is greater than the first "
                                         r"dimension of tensor\."):
        hvd.alltoall(np.ones((n, 1)), splits=np.full(n, 2, dtype=np.int32), name="a3")
    with pytest.raises(ValueError, match=r"^Number of entries in splits does not equal number "
                                         r"of workers\."):
        hvd.alltoall(np.ones((n, 1)), splits=np.ones(n + 1, dtype=np.int32), name="a4")
    if n > 1:
        with pytest.raises(ValueError, match=r"^splits not provided, but first dimension of "
                                             r"tensor is not an even multiple of the number of "
                                             r"workers\."):
            hvd.alltoall(np.ones((n * 2 + 1, 1)), name="a5")
    with pytest.raises(ValueError, match=r"^The op parameter supersedes average"):
        hvd.allreduce(np.ones(1), op=hvd.Sum, average=True, name="both")
    with pytest.raises(ValueError, match=r"not supported"):
        hvd.allreduce(np.ones(1, dtype=np.complex64), name="complex")
    with pytest.raises(NotImplementedError):
        hvd.allreduce(np.ones(1), op=hvd.Adasum, name="adasum")
    # None of the rejected calls left anything pending: a collective still works.
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="still_ok"),
                               np.full(2, hvd.size()))
