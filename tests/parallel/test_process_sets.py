"""Process sets under real ranks: static sets at init, dynamic add/remove, set-relative ranks,
global broadcast roots, membership errors, and sets working concurrently."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import collective as hvd
from collective import _current
from tests._spmd import spmd_driver
from tests.parallel._util import env_size

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(90)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=120)

N = env_size()
EVENS = hvd.ProcessSet(range(0, N, 2))
ODDS = hvd.ProcessSet(range(1, N, 2)) if N > 1 else None
LAST = hvd.ProcessSet([N - 1])
STATIC = [ps for ps in (EVENS, ODDS, LAST) if ps is not None and (
    N > 2 or ps is not LAST)]  # at np 2, LAST == ODDS; at np 1, LAST == EVENS


@pytest.fixture(scope="module", autouse=True)
def world():
    assert EVENS.process_set_id is None and EVENS.rank() is None
    hvd.init(process_sets=STATIC)
    assert hvd.size() == N
    yield
    hvd.shutdown()


def members(ps):
    return list(range(N)) if ps is hvd.global_process_set else list(ps.ranks)


def test_static_sets_registered():
    ids = [ps.process_set_id for ps in STATIC]
    assert len(set(ids)) == len(ids) and 0 not in ids and None not in ids
    g = hvd.global_process_set
    assert (g.process_set_id, g.ranks, g.size(), g.rank(), g.included()) == (
        0, list(range(N)), N, hvd.rank(), True)
    for ps in STATIC:
        assert ps.size() == len(ps.ranks)
        assert ps.included() == (hvd.rank() in ps.ranks)
        if ps.included():
            assert ps.rank() == ps.ranks.index(hvd.rank())
        else:  # Horovod's error for a rank outside the set
            with pytest.raises(ValueError, match=r"^Process is not part of provided process "
                                                 r"set\.$"):
                ps.rank()
        assert str(ps) == (f"ProcessSet(process_set_id={ps.process_set_id}, "
                           f"ranks={ps.ranks}, mpi_comm=None)")


@pytest.mark.parametrize("which", range(3))
def test_collectives_inside_static_sets(which):
    if which >= len(STATIC):
        pytest.skip("no such set at this world size")
    ps = STATIC[which]
    me = hvd.rank()
    if not ps.included():
        with pytest.raises(ValueError, match=rf"^Allreduce: Rank {me} is not a member of the "
                                             r"provided process set\."):
            hvd.allreduce(np.ones(1), process_set=ps, name="nonmember")
        return
    mem = ps.ranks
    got = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, process_set=ps, name="ps.sum")
    np.testing.assert_allclose(got, np.full(3, sum(r + 1 for r in mem)))
    avg = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Average, process_set=ps, name="ps.avg")
    np.testing.assert_allclose(avg, np.full(3, sum(r + 1 for r in mem) / len(mem)))
    gathered = hvd.allgather(np.full((me + 1, 2), me), process_set=ps, name="ps.ag")
    np.testing.assert_array_equal(gathered,
                                  np.concatenate([np.full((r + 1, 2), r) for r in mem]))
    root = mem[-1]  # a GLOBAL rank, translated by the runtime
    b = hvd.broadcast(np.full(2, float(me)), root_rank=root, process_set=ps, name="ps.bc")
    np.testing.assert_array_equal(b, np.full(2, float(root)))
    outside = [r for r in range(N) if r not in mem]
    if outside:
        with pytest.raises(ValueError, match=r"^broadcast received invalid root rank"):
            hvd.broadcast(np.ones(1), root_rank=outside[0], process_set=ps, name="ps.badroot")
    out, recv = hvd.alltoall(np.full((len(mem), 1), me), splits=np.ones(len(mem), np.int32),
                             process_set=ps, name="ps.a2a")
    np.testing.assert_array_equal(out.ravel(), mem)
    rs = hvd.reducescatter(np.ones((len(mem), 2)), op=hvd.Sum, process_set=ps, name="ps.rs")
    np.testing.assert_array_equal(rs, np.full((1, 2), len(mem)))
    hvd.barrier(process_set=ps)


def test_sets_run_concurrently_with_the_global_set():
    me = hvd.rank()
    hs = []
    for i in range(10):
        hs.append(("g", i, hvd.allreduce_async(np.full(4, float(i)), op=hvd.Sum,
                                               name=f"conc.g.{i}")))
        for k, ps in enumerate(STATIC):
            if ps.included():
                hs.append((k, i, hvd.allreduce_async(np.full(4, float(i)), op=hvd.Sum,
                                                     process_set=ps, name=f"conc.{k}.{i}")))
    for k, i, h in hs:
        n = N if k == "g" else len(STATIC[k].ranks)
        np.testing.assert_allclose(h.wait(30), np.full(4, float(i * n)), err_msg=f"{k} {i}")
    assert me == hvd.rank()


def test_same_name_in_different_sets_is_not_a_duplicate():
    ps = EVENS
    if not ps.included():
        return
    a = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="shared")
    b = hvd.allreduce_async(np.ones(2), op=hvd.Sum, process_set=ps, name="shared")
    np.testing.assert_allclose(b.wait(30), np.full(2, len(ps.ranks)))
    np.testing.assert_allclose(a.wait(30), np.full(2, N)) if N == len(ps.ranks) else None


def test_same_name_in_different_sets_global_side():
    # Ranks outside EVENS still take part in the global 'shared' op of the previous test.
    if EVENS.included():
        return
    np.testing.assert_allclose(
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="shared"), np.full(2, N))


def test_unnamed_ops_on_a_subset_leave_global_unnamed_ops_matched():
    # Horovod's own example: only the members run an unnamed op on their set, then everyone
    # runs unnamed global ops. Unnamed ops are numbered per set, so the members' global ops
    # keep the numbers of the other ranks' (one process-wide count hung here, or reduced two
    # different ops together where shapes matched).
    me = hvd.rank()
    if EVENS.included():
        got = hvd.allreduce_async(np.ones(2), op=hvd.Sum, process_set=EVENS).wait(30)
        np.testing.assert_allclose(got, np.full(2, len(EVENS.ranks)))
    a = hvd.allreduce_async(np.full(2, float(me)), op=hvd.Sum)
    b = hvd.allreduce_async(np.full(2, 10.0 * me), op=hvd.Sum)
    np.testing.assert_allclose(a.wait(30), np.full(2, float(sum(range(N)))))
    np.testing.assert_allclose(b.wait(30), np.full(2, 10.0 * sum(range(N))))


def test_adding_without_dynamic_mode_is_refused():
    with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding "
                                         r"process sets after Horovod initialization\."):
        hvd.add_process_set([0])
    # Horovod returns False for the global set and refuses a registered one with its text.
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing "
                                         r"process sets after Horovod initialization\."):
        hvd.remove_process_set(STATIC[0])
    assert STATIC[0].process_set_id is not None


def test_duplicate_static_sets_are_rejected():
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match=r"^Attempted to add a duplicate process set"):
            hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])])
    finally:
        hvd.shutdown()
        hvd.init(process_sets=STATIC)


def test_shutdown_unbinds_the_sets_and_init_registers_them_afresh():
    hvd.shutdown()
    try:
        for ps in STATIC:
            assert (ps.process_set_id, ps.size(), ps.rank()) == (None,) * 3
            with pytest.raises(ValueError, match=r"^Horovod has not been initialized"):
                ps.included()  # Horovod's included() needs init too
        assert hvd.global_process_set.ranks is None
        # Only the last set this time: it takes id 1, so the others, left out, must be
        # refused as unregistered rather than run on the set that now has their old id.
        last = STATIC[-1]
        hvd.init(process_sets=[last])
        assert last.process_set_id == 1
        for ps in STATIC[:-1]:
            assert ps.process_set_id is None
            with pytest.raises(ValueError, match=r"^Allreduce: Process set provided does not "
                                                 r"exist, or has not been registered\."):
                hvd.allreduce(np.ones(1), process_set=ps, name="stale")
        if last.included():
            got = hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=last, name="fresh")
            np.testing.assert_allclose(got, np.full(1, len(last.ranks)))
        # Nobody shuts down while a member still works in the set (shutdown is collective).
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="fresh.done")
    finally:
        hvd.shutdown()
        hvd.init(process_sets=STATIC)
    assert [ps.process_set_id for ps in STATIC] == list(range(1, len(STATIC) + 1))


def test_dynamic_sets_add_use_remove():
    hvd.shutdown()
    before = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")
    hvd.init(process_sets="dynamic")  # sets the variable, as Horovod: restored below
    try:
        me = hvd.rank()
        a = hvd.add_process_set(sorted({0, N - 1}))
        assert a.process_set_id is not None and a.ranks == sorted({0, N - 1})
        # At np <= 2, [0, N-1] is every rank: the whole world is then a duplicate of `a`.
        everyone = hvd.ProcessSet(range(N))
        if everyone.ranks == a.ranks:
            with pytest.raises(ValueError, match=r"^Attempted to add a duplicate process set"):
                hvd.add_process_set(everyone)
            b = a
        else:
            b = hvd.add_process_set(everyone)
            assert b.process_set_id != a.process_set_id
        with pytest.raises(ValueError, match=r"^Attempted to add a duplicate process set"):
            hvd.add_process_set(a)
        if N > 1:  # ranks asking for different sets: every rank learns who asked for what
            others = ", ".join(map(str, range(1, N)))
            want = (rf"rank\(s\) 0 called add_process_set\(\[0\]\); rank\(s\) {others} "
                    rf"called add_process_set\(\[{N - 1}\]\)\. Every rank must")
            with pytest.raises(ValueError, match=want):
                hvd.add_process_set([0] if me == 0 else [N - 1])
        if a.included():
            got = hvd.allreduce(np.full(2, me + 1.0), op=hvd.Sum, process_set=a, name="dyn")
            np.testing.assert_allclose(got, np.full(2, sum(r + 1 for r in a.ranks)))
        if b.included():
            got = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=b, name="dyn.b")
            np.testing.assert_allclose(got, np.full(2, len(b.ranks)))
        old_id = a.process_set_id
        lone = None  # an op only one member submits: the removal fails it, naming it
        if len(a.ranks) > 1 and me == a.ranks[0]:
            lone = hvd.allreduce_async(np.ones(1), process_set=a, name="lone")
        assert hvd.remove_process_set(a) is True
        if lone is not None:
            want = re.escape(f"process set {old_id} (ranks {a.ranks}) was removed by "
                             "remove_process_set() while 'allreduce.lone' waited on rank "
                             f"{me}; wait for a set's ops")
            with pytest.raises(ValueError, match="^" + want):
                lone.wait(30)
        assert a.process_set_id is None
        assert hvd.remove_process_set(a) is False
        with pytest.raises(ValueError, match="does not exist, or has not been registered"):
            hvd.allreduce(np.ones(1), process_set=a, name="gone")
        c = hvd.add_process_set([N - 1])
        assert c.process_set_id == old_id  # ids come back from a free list
        if c.included():
            np.testing.assert_allclose(
                hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=c, name="c"), np.ones(1))
        # A thread that resolved the set just before another removed it must not queue its
        # op into the dropped set (it waited forever): the late submit is refused.
        rt = _current.current()
        stale = rt.process_set_state(c, "Allreduce") if c.included() else None
        assert hvd.remove_process_set(c)
        if stale is not None:
            rt.process_set_state = lambda ps, label: stale
            try:
                with pytest.raises(ValueError, match=r"^Process set provided does not exist.*"
                                                     r"was removed by remove_process_set\(\) "
                                                     r"while 'allreduce.late' was being submitted"):
                    hvd.allreduce_async(np.ones(1), process_set=c, name="late").wait(10)
            finally:
                del rt.process_set_state  # the method again
        if b is not a:
            assert hvd.remove_process_set(b)
        np.testing.assert_allclose(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.dyn"),
                                   np.full(1, N))
    finally:
        hvd.shutdown()
        if before is None:  # later tests of this process run without dynamic sets
            os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
        else:
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = before
        hvd.init(process_sets=STATIC)
