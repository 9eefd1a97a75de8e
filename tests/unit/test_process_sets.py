"""Process sets under loopback ranks (threads of this process): the texts of
`remove_process_set()` for the ops it fails and the submits it refuses."""
from __future__ import annotations

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


def test_the_global_set_lists_every_rank_once_initialised():
    g = hvd.global_process_set
    assert not hvd.is_initialized()
    assert (g.process_set_id, g.ranks, g.size(), g.rank(), g.included()) == (0, None, None,
                                                                              None, None)
    hvd.init()
    try:
        assert (g.ranks, g.size(), g.rank(), g.included()) == ([0], 1, 0, True)
        assert str(g) == "ProcessSet(process_set_id=0, ranks=[0], mpi_comm=None)"
    finally:
        hvd.shutdown()
    assert (g.ranks, g.size(), g.rank(), g.included()) == (None, None, None, None)


@pytest.mark.timeout(60)
def test_the_global_set_answers_for_each_ranks_runtime():
    def body(rank):
        g = hvd.global_process_set
        return g.ranks, g.size(), g.rank(), g.included(), hash(g)

    got = run_loopback(3, body, timeout=40)
    assert got == [([0, 1, 2], 3, r, True, hash(hvd.global_process_set)) for r in range(3)]
