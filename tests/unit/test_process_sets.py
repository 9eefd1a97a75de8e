"""Process sets in one process (loopback ranks as threads, or the size-1 world): the texts of
`remove_process_set()` for the ops it fails and the submits it refuses, and what it returns
for the global and unregistered sets; the global set's ranks; `included()`/`rank()`/`size()`
as Horovod's; sets unbound by `shutdown()` (or a failed `init()`) and registered afresh later."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import collective as hvd
from collective._current import current
from collective.gradset import GradientSet
from collective.types import DataType, ReduceOp
from tests._spmd import run_loopback


def _removed(ps_id, ranks, rank, waited):
    return (f"process set {ps_id} (ranks {ranks}) was removed by remove_process_set() while "
            f"{waited} waited on rank {rank}; wait for a set's ops (synchronize) before "
            "removing it")


@pytest.mark.timeout(60)
def test_removal_names_the_first_five_waiting_ops_and_counts_the_rest():
    def body(rank):
        a = hvd.add_process_set([0, 1])
        ps_id = a.process_set_id
        hs = []
        if rank == 0:  # ops the other member never submits: the removal fails them
            hs = [hvd.allreduce_async(np.ones(1), process_set=a, name=f"w{i}") for i in range(7)]
        assert hvd.remove_process_set(a)
        texts = []
        for h in hs:
            with pytest.raises(ValueError) as info:
                h.wait(10)
            texts.append(str(info.value))
        return ps_id, texts

    (ps_id, texts), (_, none), (_, none2) = run_loopback(3, body, timeout=40,
                                                          dynamic_process_sets=True)
    shown = ", ".join(f"'allreduce.w{i}'" for i in range(5)) + " and 2 more"
    assert texts == [_removed(ps_id, [0, 1], 0, shown)] * 7
    assert none == none2 == []


@pytest.mark.timeout(60)
def test_removal_names_a_few_waiting_ops_in_full():
    def body(rank):
        a = hvd.add_process_set([0, 1])
        h = hvd.allreduce_async(np.ones(1), process_set=a, name="lone") if rank == 1 else None
        assert hvd.remove_process_set(a)
        if h is None:
            return None
        with pytest.raises(ValueError) as info:
            h.wait(10)
        return str(info.value)

    got = run_loopback(3, body, timeout=40, dynamic_process_sets=True)
    assert got[0] is None and got[2] is None
    assert got[1] == _removed(1, [0, 1], 1, "'allreduce.lone'")


@pytest.mark.timeout(60)
def test_removal_with_only_gradient_sets_waiting_names_them():
    """A set whose only waiting work is a gradient set's (collective/gradset.py): the removal
    fails its wait and says so. Driven by hand (no coordinator thread), with the gradient set
    put in place directly: registration itself refuses dynamic process sets."""
    def body(rank):
        rt = current()
        h = rt.request_process_set_change("add", hvd.ProcessSet([0, 1]))
        rt.coordinator.run_cycle()
        a = h.wait(10)
        gs = None
        if rank == 0:
            gs = GradientSet(["allreduce.g0"], [(2,)], [DataType.FLOAT32], -1,
                             ReduceOp.SUM, 1.0, 1.0, 0.0)
            rt.process_set_state(a, "test").sets.append(gs)
            gs.submit(0, np.ones(2, np.float32))
        h = rt.request_process_set_change("remove", a.process_set_id)
        rt.coordinator.run_cycle()
        assert h.wait(10) is True
        if gs is None:
            return None
        with pytest.raises(ValueError) as info:
            gs.wait()
        return str(info.value)

    got = run_loopback(2, body, timeout=40, start=False, dynamic_process_sets=True)
    assert got == [_removed(1, [0, 1], 0, "its gradient sets' ops"), None]


@pytest.mark.timeout(60)
def test_a_submit_refused_after_the_removal_says_what_to_do():
    """A thread that resolved the set just before another removed it: its submit is refused,
    naming the set, the op and the rank, and saying how to avoid it."""
    def body(rank):
        rt = current()
        a = hvd.add_process_set([0, 1])
        stale = rt.process_set_state(a, "Allreduce") if rank < 2 else None
        ps_id = a.process_set_id
        assert hvd.remove_process_set(a)
        if stale is None:
            return None
        rt.process_set_state = lambda ps, label: stale
        try:
            with pytest.raises(ValueError) as info:
                hvd.allreduce_async(np.ones(1), process_set=a, name="late")
        finally:
            del rt.process_set_state  # the method again
        return ps_id, str(info.value)

    got = run_loopback(3, body, timeout=40, dynamic_process_sets=True)
    for rank, (ps_id, text) in enumerate(got[:2]):
        assert text == ("Process set provided does not exist, or has not been registered: "
                        f"process set {ps_id} (ranks [0, 1]) was removed by "
                        "remove_process_set() while 'allreduce.late' was being submitted on "
                        f"rank {rank}; synchronize a set's ops and stop submitting to it "
                        "before removing it"), text
    assert got[2] is None


def test_removing_the_global_set_or_an_unregistered_one_returns_false(monkeypatch):
    """As Horovod: remove_process_set() answers False for the global set and for a set that is
    not registered (before init too); without dynamic mode, removing a registered set is
    refused with Horovod's text for removing, and the set stays registered."""
    g, loose, a = hvd.global_process_set, hvd.ProcessSet([0]), hvd.ProcessSet([0])
    assert (hvd.remove_process_set(g), hvd.remove_process_set(loose)) == (False, False)
    hvd.init(process_sets=[a])
    try:
        assert (hvd.remove_process_set(g), hvd.remove_process_set(loose)) == (False, False)
        with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow "
                                             r"removing process sets after Horovod "
                                             r"initialization\.$"):
            hvd.remove_process_set(a)
        assert a.process_set_id == 1
        with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow "
                                             r"adding process sets after Horovod "
                                             r"initialization\.$"):
            hvd.add_process_set([0])
    finally:
        hvd.shutdown()
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    hvd.init(process_sets="dynamic")
    try:
        assert hvd.remove_process_set(g) is False and g.process_set_id == 0
        b = hvd.add_process_set([0])
        assert hvd.remove_process_set(b) is True and hvd.remove_process_set(b) is False
    finally:
        hvd.shutdown()


def _uninitialised(*queries):
    """Each query raises Horovod's not-initialised ValueError."""
    for query in queries:
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use "
                                             r"hvd\.init\(\)\.$"):
            query()
    return True


def test_the_global_set_lists_every_rank_once_initialised():
    g = hvd.global_process_set
    assert not hvd.is_initialized()
    assert (g.process_set_id, g.ranks) == (0, None)
    assert _uninitialised(g.size, g.rank, g.included)  # as Horovod's
    hvd.init()
    try:
        assert (g.ranks, g.size(), g.rank(), g.included()) == ([0], 1, 0, True)
        assert str(g) == "ProcessSet(process_set_id=0, ranks=[0], mpi_comm=None)"
    finally:
        hvd.shutdown()
    assert g.ranks is None and _uninitialised(g.size, g.rank, g.included)


@pytest.mark.timeout(60)
def test_a_sets_included_rank_and_size_answer_as_horovods():
    """Horovod's ProcessSet: `included()` is whether this rank is in `ranks`, registered or
    not (it raises before init); `rank()` and `size()` are None while the set is not
    registered, and `rank()` raises for a rank outside a registered set."""
    loose = hvd.ProcessSet([0])
    assert (loose.size(), loose.rank()) == (None, None) and _uninitialised(loose.included)

    def body(rank):
        a = hvd.add_process_set([1])
        got = [loose.included(), loose.size(), loose.rank(), a.included(), a.size()]
        try:
            got.append(a.rank())
        except ValueError as exc:
            got.append(str(exc))
        assert hvd.remove_process_set(a)
        return got

    got = run_loopback(2, body, timeout=40, dynamic_process_sets=True)
    assert got == [[True, None, None, False, 1, "Process is not part of provided process set."],
                   [False, None, None, True, 1, 0]]




@pytest.mark.timeout(60)
def test_the_global_set_answers_for_each_ranks_runtime():
    def body(rank):
        g = hvd.global_process_set
        return g.ranks, g.size(), g.rank(), g.included(), hash(g)

    got = run_loopback(3, body, timeout=40)
    assert got == [([0, 1, 2], 3, r, True, hash(hvd.global_process_set)) for r in range(3)]


def _unbound(ps):
    """Unregistered: no id, and size() and rank() are None (included() still answers from the
    ranks once initialised, and raises when not)."""
    return (ps.process_set_id, ps.size(), ps.rank()) == (None,) * 3


def test_shutdown_unbinds_a_static_set_and_init_registers_it_afresh():
    a = hvd.ProcessSet([0])
    by_set = {a: "a"}  # a set as a key stays found whether registered or not
    for _ in range(2):
        hvd.init(process_sets=[a])
        try:
            assert (a.process_set_id, a.size(), a.rank(), a.included()) == (1, 1, 0, True)
            np.testing.assert_array_equal(hvd.allreduce(np.ones(1), process_set=a, name="a"),
                                          np.ones(1))
            assert by_set[a] == "a"
        finally:
            hvd.shutdown()
        assert _unbound(a) and a.ranks == [0] and _uninitialised(a.included)
        assert by_set[a] == "a"


def test_a_set_added_before_shutdown_can_be_added_after_the_next_init(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # init("dynamic") sets it
    hvd.init(process_sets="dynamic")
    try:
        a = hvd.add_process_set([0])
    finally:
        hvd.shutdown()
    assert _unbound(a)
    hvd.init(process_sets="dynamic")
    try:
        assert hvd.add_process_set(a) is a and a.process_set_id == 1
        assert hvd.remove_process_set(a) and _unbound(a) and a.included()
    finally:
        hvd.shutdown()


def test_a_failed_init_unbinds_the_sets_it_had_registered():
    a, dup = hvd.ProcessSet([0]), hvd.ProcessSet([0])
    with pytest.raises(ValueError, match="^Attempted to add a duplicate process set"):
        hvd.init(process_sets=[a, dup])
    assert not hvd.is_initialized()
    assert _unbound(a) and _unbound(dup)


@pytest.mark.timeout(60)
def test_a_set_left_out_of_the_next_init_is_not_taken_for_the_set_with_its_old_id():
    """Sets [0] and [0, 1] get ids 1 and 2; after shutdown, init() with [0, 1] alone gives it
    id 1. The left-out set must be refused as unregistered, not resolved to [0, 1]."""
    from collective.config import read_env
    from collective.engines.loopback import LoopbackWorld
    from collective.runtime import Runtime

    n = 2
    sets = [(hvd.ProcessSet([0]), hvd.ProcessSet([0, 1])) for _ in range(n)]

    def world(sets_of):
        plane = LoopbackWorld(n, timeout=10.0)
        made, raised = [None] * n, []

        def body(r):
            try:
                made[r] = Runtime.create(config=read_env({}), control=plane.plane(r),
                                         mode="loopback", process_sets=sets_of(r))
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised.append(exc)

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert raised == [] and None not in made
        return made

    first = world(lambda r: list(sets[r]))
    assert [(a.process_set_id, b.process_set_id) for a, b in sets] == [(1, 2)] * n
    for rt in first:
        rt.shutdown(timeout=5.0)  # never started: closes what it made
    assert all(_unbound(a) and _unbound(b) for a, b in sets)
    second = world(lambda r: [sets[r][1]])
    for r, rt in enumerate(second):
        a, b = sets[r]
        assert b.process_set_id == 1 and a.process_set_id is None
        assert rt.process_set_state(b, "Allreduce").ranks == [0, 1]
        with pytest.raises(ValueError, match=r"^Allreduce: Process set provided does not "
                                             r"exist, or has not been registered\.$"):
            rt.process_set_state(a, "Allreduce")
        rt.shutdown(timeout=5.0)


@pytest.mark.timeout(60)
def test_adding_a_set_with_more_ranks_than_the_job_fails_that_call_on_every_rank():
    # More ranks than the job has was taken for a malformed message on the coordinator
    # thread, which ended the job; it is the caller's mistake, reported like any rank out of
    # range, and the job goes on.
    def body(rank):
        errors = []
        for ranks in ([0, 1, 2], [0, 5]):
            with pytest.raises(ValueError) as info:
                hvd.add_process_set(ranks)
            errors.append(str(info.value))
        ps = hvd.add_process_set([0, 1])
        got = hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=ps, name="after")
        return errors, float(got[0])

    for errors, total in run_loopback(2, body, timeout=40, dynamic_process_sets=True):
        assert errors == ["process set ranks [0, 1, 2] out of range for size 2",
                          "process set ranks [0, 5] out of range for size 2"]
        assert total == 2.0


@pytest.mark.timeout(60)
def test_a_registered_set_survives_deepcopy_and_pickling():
    # A model holding a set (SyncBatchNorm's process_set) is deep-copied (EMA, best-model
    # copies) and saved: the set's live runtime (locks) made both raise. A copy is the set
    # itself; unpickled in the same job it is the registered set again, after its removal an
    # unregistered set of the same ranks.
    import copy
    import pickle

    def body(rank):
        ps = hvd.add_process_set([0, 1])
        holder = {"bn": ps, "eps": 1e-5}
        assert copy.deepcopy(holder)["bn"] is ps and copy.copy(ps) is ps
        data = pickle.dumps(holder)
        assert pickle.loads(data)["bn"] is ps
        assert pickle.loads(pickle.dumps(hvd.global_process_set)) is hvd.global_process_set
        assert hvd.remove_process_set(ps)
        later = pickle.loads(data)["bn"]
        return later is not ps, later.ranks, later.process_set_id

    assert run_loopback(2, body, timeout=40, dynamic_process_sets=True) == [
        (True, [0, 1], None)] * 2
