"""`join()` (global process set) meets ops on other process sets: an op of another set that
waits for a rank blocked in the global `join()` fails, on every rank that submitted it, naming
the tensor, the set, the joined rank and the fix, instead of hanging; the joined rank logs
the same text and its join completes once the others join.

Three ranks, sets LEFT = [0, 1] (the joined rank 1 is not the set's rank 0) and RIGHT = [1, 2]
(it is). Both orders (the op first, the join first; sleeps only bias the order, both give the
same outcome), with the op's response cached and not, in the mpi and tcp modes and with the
response cache off.
"""
from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest

import collective as hvd
from tests._spmd import in_spmd_rank, run_spmd, spmd_driver
from tests.parallel._util import env_size, within

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(60)]

test_spmd = spmd_driver(__file__, nps=(3,), timeout=150)
test_spmd_nocache = spmd_driver(__file__, nps=(3,), timeout=150,
                                env={"HOROVOD_CACHE_CAPACITY": "0"})


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(180)
def test_spmd_tcp():
    run_spmd(__file__, 3, timeout=150, mode="tcp")


N = env_size()
JOINER = 1
LEFT = hvd.ProcessSet([0, 1])
RIGHT = hvd.ProcessSet([1, 2])
ORDER_BIAS = 0.5  # seconds one side sleeps to come second


@pytest.fixture(scope="module", autouse=True)
def world():
    if not in_spmd_rank():  # the drivers
        yield
        return
    if N != 3:
        pytest.skip("written for 3 ranks")
    hvd.init(process_sets=[LEFT, RIGHT])
    yield
    hvd.shutdown()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _my_set():
    return LEFT if hvd.rank() == 0 else RIGHT


def _text(kind: str, name: str, ps) -> str:
    """The error every submitting rank gets (a regex)."""
    ranks = ", ".join(map(str, ps.ranks))
    others = ", ".join(str(r) for r in ps.ranks if r != JOINER)
    return (rf"^The {kind} of tensor '[^']*{re.escape(name)}' on process set "
            rf"{ps.process_set_id} \(ranks \[{ranks}\]\) cannot complete: rank\(s\) {JOINER} "
            rf"called hvd\.join\(\) and wait there without submitting it \(rank\(s\) {others} "
            r"submitted it\)\. join\(\) covers the global process set only: .* Finish the ops "
            rf"on process set {ps.process_set_id} on every member before calling hvd\.join\(\)")


def _run(kind: str, name: str, ps):
    if kind == "ALLREDUCE":
        return hvd.allreduce(np.ones(3), op=hvd.Sum, name=name, process_set=ps)
    return hvd.broadcast(np.ones(3), root_rank=hvd.rank(), name=name, process_set=ps)


def _warm_cache(name: str) -> None:
    """Runs `name` once on each set with every member, so its response is cached."""
    me = hvd.rank()
    for ps in (LEFT, RIGHT):
        if ps.included():
            np.testing.assert_allclose(
                hvd.allreduce(np.ones(3), op=hvd.Sum, name=name, process_set=ps),
                np.full(3, 2.0))


def _all_agree_on(last: int) -> None:
    got = hvd.allgather(np.array([last], dtype=np.int64), name="jps.last")
    assert len(set(got.tolist())) == 1, got


@pytest.mark.parametrize("kind,cached", [("ALLREDUCE", False), ("ALLREDUCE", True),
                                         ("BROADCAST", False)],
                         ids=["allreduce", "allreduce-cached", "broadcast"])
@pytest.mark.parametrize("order", ["op-first", "join-first"])
def test_op_of_another_set_waiting_for_a_joined_rank_fails_everywhere(order, kind, cached):
    me = hvd.rank()
    name = f"jps.{order}.{kind.lower()}.{int(cached)}"
    if cached:
        _warm_cache(name)
    hvd.barrier()
    if me == JOINER:
        cap = _Capture()
        logger = logging.getLogger("horovod")
        logger.addHandler(cap)
        try:
            if order == "op-first":
                time.sleep(ORDER_BIAS)
            with within(20.0, "join while the other sets' ops fail"):
                last = hvd.join()
        finally:
            logger.removeHandler(cap)
        assert last in (0, 2)
        # The joined rank names what failed on the others, as they see it.
        for ps in (LEFT, RIGHT):
            pattern = _text(kind, name, ps)[1:]  # embedded in the log line
            assert any(re.search(pattern, line) for line in cap.lines), (
                f"no log line on rank {me} matches {pattern!r}: {cap.lines}")
    else:
        if order == "join-first":
            time.sleep(ORDER_BIAS)
        ps = _my_set()
        with within(10.0, "the op's error"):
            with pytest.raises(hvd.HorovodInternalError, match=_text(kind, name, ps)):
                _run(kind, name, ps)
        last = hvd.join()
    _all_agree_on(last)


def test_op_the_joined_rank_submitted_before_joining_completes():
    # Rank 1 submits a LEFT op, then joins; rank 0 submits it later: it runs with rank 1's
    # real tensor, no error.
    me = hvd.rank()
    for cached in (False, True):
        name = f"jps.early.{int(cached)}"
        if cached:
            _warm_cache(name)
        hvd.barrier()
        if me == JOINER:
            h = hvd.allreduce_async(np.full(3, 2.0), op=hvd.Sum, name=name, process_set=LEFT)
            last = hvd.join()
            np.testing.assert_allclose(hvd.synchronize(h), np.full(3, 3.0))
        elif me == 0:
            time.sleep(ORDER_BIAS)
            got = hvd.allreduce(np.full(3, 1.0), op=hvd.Sum, name=name, process_set=LEFT)
            np.testing.assert_allclose(got, np.full(3, 3.0))
            last = hvd.join()
        else:
            last = hvd.join()
        _all_agree_on(last)


def test_sets_work_after_the_join():
    # Names that failed above run normally once every rank is back, cached again afterwards.
    for _ in range(3):
        for ps in (LEFT, RIGHT):
            if ps.included():
                got = hvd.allreduce(np.ones(3), op=hvd.Sum,
                                    name="jps.op-first.allreduce.1", process_set=ps)
                np.testing.assert_allclose(got, np.full(3, 2.0))
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="jps.global"),
                               np.full(2, 3.0))
