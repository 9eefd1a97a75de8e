"""init()'s exchange, under loopback ranks: every rank takes rank 0's values of the options that
shape what the ranks exchange (a rank whose own differ warns), ranks that pass different
process sets to init() ("dynamic" on some only; other static sets, a communicator counting as
its ranks) all raise the same ValueError, and the communicators of a split (each rank its own)
register one set each."""
from __future__ import annotations

import os
import sys
import threading
import time
import types

import numpy as np
import pytest

import collective as hvd
from collective._current import current
from collective.config import read_env
from collective.engines.loopback import LoopbackWorld
from collective.runtime import Runtime
from tests._spmd import run_loopback

N = 3


def rounds_of_eight(rank, iterations=6):
    """Eight named allreduces at once, several times over (the later ones take the cache path,
    which fuses on each rank alone), and one at a time; every result checked."""
    for _ in range(iterations):
        hs = [hvd.allreduce_async(np.full(4, float(k + 100 * rank), np.float32), name=f"n{k}",
                                  op=hvd.Sum) for k in range(8)]
        for k, h in enumerate(hs):
            np.testing.assert_array_equal(hvd.synchronize(h),
                                          np.full(4, float(N * k + 100 * sum(range(N)))))
        for k in range(8):
            out = hvd.allreduce(np.full(k + 1, float(k + 10 * rank), np.float32), name=f"n{k}",
                                op=hvd.Sum)
            np.testing.assert_array_equal(out, np.full(k + 1, float(N * k + 10 * sum(range(N)))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,env,value", [
    ("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", 0),
    ("cache_capacity", "HOROVOD_CACHE_CAPACITY", 2),
    ("cache_capacity", "HOROVOD_CACHE_CAPACITY", 0),
])
def test_rank_0s_value_applies_on_every_rank(horovod_log, field, env, value):
    def body(rank):
        rounds_of_eight(rank)
        return getattr(current().config, field)

    got = run_loopback(N, body, timeout=40,
                       rank_config=lambda r: {field: value} if r == 0 else {})
    assert got == [value] * N
    default = getattr(read_env({}), field)
    want = (f"{env} is {default!r} on this rank but {value!r} on rank 0; every rank uses "
            "rank 0's value")
    assert horovod_log.lines(f"{env} is ") == [(f"loopback-rank-{r}", want) for r in range(1, N)]


@pytest.mark.timeout(60)
def test_every_shared_option_is_rank_0s(horovod_log):
    """Options whose difference would change what a rank sends: the fusion threshold and group
    fusion (the cache path fuses on each rank), the cache capacity (its bit numbers), autotune
    (its exchanges at a join, the optimizer's bucket schedule), the bucket size (the optimizer's
    allreduces) and dynamic process sets (an exchange every cycle)."""
    mine = {"fusion_threshold": 1, "cache_capacity": 0, "disable_group_fusion": True,
            "bucket_cap_mb": 1.0, "autotune": True, "dynamic_process_sets": True}

    def body(rank):
        rounds_of_eight(rank, iterations=2)
        rt = current()
        return {f: getattr(rt.config, f) for f in mine}, rt.dynamic_process_sets

    got = run_loopback(N, body, timeout=40, rank_config=lambda r: mine if r == 1 else {})
    defaults = read_env({})
    assert got == [({f: getattr(defaults, f) for f in mine}, False)] * N
    warned = horovod_log.lines("on rank 0; every rank uses rank 0's value")
    assert [who for who, _ in warned] == ["loopback-rank-1"] * len(mine)
    for env in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CACHE_CAPACITY",
                "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_BUCKET_CAP_MB", "HOROVOD_AUTOTUNE",
                "HOROVOD_DYNAMIC_PROCESS_SETS"):
        assert sum(text.startswith(f"{env} is ") for _, text in warned) == 1, (env, warned)


def init_every_rank(sets_of, config_of=None):
    """Creates a loopback runtime on N threads with `process_sets=sets_of(rank)` (and the
    config `config_of(rank)`, default the defaults); returns what each rank's creation raised
    (None: it succeeded) and the runtimes made."""
    world = LoopbackWorld(N, timeout=5.0)
    cfg = read_env({})
    raised: list = [None] * N
    made: list = [None] * N

    def body(rank):
        try:
            made[rank] = Runtime.create(config=config_of(rank) if config_of else cfg,
                                        control=world.plane(rank), mode="loopback",
                                        process_sets=sets_of(rank))
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            raised[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    world.exchange.abort("test over")
    return raised, made


class FakeComm:
    """An mpi4py communicator as `ProcessSet` and the runtime see it: its members' world ranks,
    in its own rank order (its group is itself)."""

    def __init__(self, world_ranks):
        self.world_ranks = list(world_ranks)

    def Get_group(self):
        return self

    def Get_size(self):
        return len(self.world_ranks)

    def Free(self):
        """Groups are freed after use; the stand-in's group is the communicator itself."""


@pytest.fixture
def fake_mpi(monkeypatch):
    """A stand-in `mpi4py.MPI` (loopback ranks share one process): COMM_NULL, a world of N
    ranks and Group.Translate_ranks (the real thing runs in tests/parallel/_init_agree.py)."""
    mpi = types.SimpleNamespace(
        COMM_NULL=FakeComm([]), COMM_WORLD=FakeComm(range(N)),
        Group=types.SimpleNamespace(
            Translate_ranks=lambda group, ranks, world: [group.world_ranks[i] for i in ranks]))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return mpi


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets_of,shown", [
    (lambda r: [hvd.ProcessSet([0, 2] if r == 2 else [0, 1])],
     "ranks [0, 1] passed [[0, 1]]; ranks [2] passed [[0, 2]]"),
    (lambda r: [hvd.ProcessSet([0, 1])] if r == 0 else [],
     "ranks [0] passed [[0, 1]]; ranks [1, 2] passed []"),
    (lambda r: [hvd.ProcessSet([1, 2]), hvd.ProcessSet([0, 1])][::1 if r else -1],
     "ranks [0] passed [[0, 1], [1, 2]]; ranks [1, 2] passed [[1, 2], [0, 1]]"),
], ids=["different-lists", "different-counts", "different-order"])
def test_different_process_sets_raise_on_every_rank(sets_of, shown):
    raised, _ = init_every_rank(sets_of)
    want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
            "the same process_sets to hvd.init(), in the same order.")
    assert [(type(e), str(e)) for e in raised] == [(ValueError, want)] * N


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets_of,shown", [
    (lambda r: "dynamic" if r == 1 else None,
     'ranks [0, 2] passed []; ranks [1] passed "dynamic"'),
    (lambda r: "dynamic" if r == 0 else [hvd.ProcessSet([0, 1])],
     'ranks [0] passed "dynamic"; ranks [1, 2] passed [[0, 1]]'),
], ids=["dynamic-or-none", "dynamic-or-static"])
def test_dynamic_on_some_ranks_raises_on_every_rank(sets_of, shown):
    """The argument is the program's choice, unlike HOROVOD_DYNAMIC_PROCESS_SETS (rank 0's
    value, `test_every_shared_option_is_rank_0s`): ranks that differ in it all raise."""
    raised, _ = init_every_rank(sets_of)
    want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
            "the same process_sets to hvd.init(), in the same order. For dynamic process sets, "
            'pass process_sets="dynamic" on every rank or set HOROVOD_DYNAMIC_PROCESS_SETS=1.')
    assert [(type(e), str(e)) for e in raised] == [(ValueError, want)] * N


@pytest.mark.timeout(60)
def test_dynamic_on_every_rank_agrees(horovod_log):
    raised, made = init_every_rank(lambda r: "dynamic")
    assert raised == [None] * N
    assert [rt.dynamic_process_sets for rt in made] == [True] * N
    assert horovod_log.lines("on rank 0; every rank uses rank 0's value") == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets_of", [
    lambda r, mpi: [hvd.ProcessSet(FakeComm([1, 0]) if r < 2 else [0, 1])],
    lambda r, mpi: [hvd.ProcessSet([0, 1] if r == 0 else FakeComm([0, 1]) if r == 1
                                   else mpi.COMM_NULL)],
    lambda r, mpi: [hvd.ProcessSet([1, 2]), hvd.ProcessSet(FakeComm([0, 1]) if r < 2
                                                           else mpi.COMM_NULL)],
], ids=["comm-and-list", "list-comm-and-null", "list-then-comm"])
def test_a_communicator_counts_as_its_world_ranks(fake_mpi, sets_of):
    """A rank passing a communicator agrees with one passing the same ranks as a list, and a
    rank outside it passes COMM_NULL (as `comm.Split` gives it)."""
    sets = [sets_of(r, fake_mpi) for r in range(N)]
    raised, made = init_every_rank(lambda r: sets[r])
    assert raised == [None] * N
    assert [[ps.ranks for ps in s] for s in sets] == [[ps.ranks for ps in sets[0]]] * N
    assert sets[0][-1].ranks == [0, 1]
    assert [s[-1].included() for s in sets] == [True, True, False]
    assert all(rt._registry[len(sets[0])] is s[-1] for rt, s in zip(made, sets))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets_of,shown", [
    (lambda r, mpi: [hvd.ProcessSet(FakeComm([0, 1]) if r < 2 else [0, 2])],
     "ranks [0, 1] passed [[0, 1]]; ranks [2] passed [[0, 2]]"),
    (lambda r, mpi: [hvd.ProcessSet(FakeComm([0, 1]) if r == 0 else mpi.COMM_NULL)],
     "ranks [0] passed [[0, 1]]; ranks [1, 2] passed [COMM_NULL]"),
], ids=["comm-and-other-list", "member-passes-null"])
def test_a_different_communicator_raises_on_every_rank(fake_mpi, sets_of, shown):
    raised, _ = init_every_rank(lambda r: sets_of(r, fake_mpi))
    want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
            "the same process_sets to hvd.init(), in the same order." + SPLIT_HINT)
    assert [(type(e), str(e)) for e in raised] == [(ValueError, want)] * N


SPLIT_HINT = (" Sets of mpi4py communicators may differ across ranks as the communicators of "
              "one split do (MPI.COMM_WORLD.Split): every member of a communicator must pass "
              "it, or its ranks, at the same place in the list.")


@pytest.mark.timeout(60)
def test_the_communicators_of_a_split_are_one_set_each(fake_mpi):
    """As `MPI.COMM_WORLD.Split(rank % 2)` gives: each rank passes its own communicator; every
    rank registers both sets (sorted by ranks), and each rank's object is the one it is in."""
    sets = [[hvd.ProcessSet(FakeComm([0, 2] if r % 2 == 0 else [1])), hvd.ProcessSet([1, 2])]
            for r in range(N)]
    raised, made = init_every_rank(lambda r: sets[r])
    assert raised == [None] * N
    assert [(s[0].process_set_id, s[0].ranks, s[0].rank(), s[0].included()) for s in sets] == [
        (1, [0, 2], 0, True), (2, [1], 0, True), (1, [0, 2], 1, True)]
    assert [s[1].process_set_id for s in sets] == [3] * N
    for r, rt in enumerate(made):
        assert {i: ps.ranks for i, ps in rt._registry.items() if i} == {
            1: [0, 2], 2: [1], 3: [1, 2]}
        other = rt.registered_set(1 if r == 1 else 2)  # the set this rank is not in
        assert other.included() is False and other.size() == (1 if r != 1 else 2)
        assert sorted(ps.id for ps in rt.member_sets()) == ([0, 2, 3] if r == 1 else
                                                            [0, 1] if r == 0 else [0, 1, 3])


@pytest.mark.timeout(60)
def test_a_rank_outside_a_split_of_several_sets_keeps_its_set_unregistered(fake_mpi):
    """`Split(rank if rank < 2 else MPI.UNDEFINED)`: sets [0] and [1]; rank 2 has COMM_NULL,
    which names neither, so its object stays unregistered; one passing a set's ranks instead
    gets that set."""
    for third, want in ((lambda mpi: mpi.COMM_NULL, (None, None, None)),
                        (lambda mpi: [1], (2, [1], False))):
        sets = [hvd.ProcessSet(FakeComm([r]) if r < 2 else third(fake_mpi)) for r in range(N)]
        raised, made = init_every_rank(lambda r: [sets[r]])
        assert raised == [None] * N
        assert [(ps.process_set_id, ps.ranks) for ps in sets[:2]] == [(1, [0]), (2, [1])]
        assert (sets[2].process_set_id, sets[2].ranks, sets[2].included()) == want
        assert all(sorted(rt._registry) == [0, 1, 2] for rt in made)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets_of,shown", [
    (lambda r, mpi: [hvd.ProcessSet(FakeComm([0, 1] if r == 0 else [1, 2]))],
     "ranks [0] passed [[0, 1]]; ranks [1, 2] passed [[1, 2]]"),
    (lambda r, mpi: [hvd.ProcessSet(FakeComm([r])), hvd.ProcessSet([0, 1])][::1 if r else -1],
     "ranks [0] passed [[0, 1], [0]]; ranks [1] passed [[1], [0, 1]]; ranks [2] passed "
     "[[2], [0, 1]]"),
], ids=["overlapping", "other-place"])
def test_communicators_that_are_no_split_raise_on_every_rank(fake_mpi, sets_of, shown):
    """A member of one communicator that names another there (or names it at another place
    of its list) is no split: every rank raises, naming what each passed."""
    raised, _ = init_every_rank(lambda r: sets_of(r, fake_mpi))
    want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
            "the same process_sets to hvd.init(), in the same order." + SPLIT_HINT)
    assert [(type(e), str(e)) for e in raised] == [(ValueError, want)] * N


@pytest.mark.timeout(60)
def test_dynamic_agrees_with_the_variable_set_elsewhere(horovod_log):
    """`process_sets="dynamic"` turns on what HOROVOD_DYNAMIC_PROCESS_SETS=1 does: a rank with
    the variable and no argument (a survivor re-initialized by an elastic reset, whose init()
    passes nothing) agrees with a rank that passes "dynamic"."""
    cfg = read_env({}).replace(dynamic_process_sets=True)
    raised, made = init_every_rank(lambda r: "dynamic" if r == 2 else None,
                                   config_of=lambda r: cfg)
    assert raised == [None] * N
    assert [rt.dynamic_process_sets for rt in made] == [True] * N
    assert horovod_log.lines("on rank 0; every rank uses rank 0's value") == []


@pytest.mark.timeout(60)
def test_a_set_without_ranks_raises_on_every_rank(fake_mpi):
    raised, _ = init_every_rank(lambda r: [hvd.ProcessSet([0, 1]),
                                           hvd.ProcessSet(fake_mpi.COMM_NULL)])
    assert [type(e) for e in raised] == [ValueError] * N
    for e in raised:
        assert str(e).startswith("process set ProcessSet("), e
        assert str(e).endswith(" has no ranks: every rank passed MPI.COMM_NULL or an empty set "
                               "(the global process set is always there; leave it out)"), e


@pytest.mark.timeout(60)
def test_add_process_set_without_ranks_raises_on_every_rank():
    def body(rank):
        with pytest.raises(ValueError, match=r"has no ranks: every rank passed MPI.COMM_NULL"):
            hvd.add_process_set([])
        return float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after")[0])

    assert run_loopback(N, body, timeout=40, dynamic_process_sets=True) == [float(N)] * N


@pytest.mark.timeout(60)
def test_a_rank_counted_as_dynamic_by_the_variable_is_named_so():
    cfg = read_env({}).replace(dynamic_process_sets=True)
    raised, _ = init_every_rank(
        lambda r: ["dynamic", None, [hvd.ProcessSet([0, 1])]][r], config_of=lambda r: cfg)
    want = ('ranks passed different process sets to init(): ranks [0] passed "dynamic"; '
            "ranks [1] passed [] with HOROVOD_DYNAMIC_PROCESS_SETS=1; ranks [2] passed "
            "[[0, 1]]. Every rank must pass the same process_sets to hvd.init(), in the same "
            'order. For dynamic process sets, pass process_sets="dynamic" on every rank or set '
            "HOROVOD_DYNAMIC_PROCESS_SETS=1.")
    assert [(type(e), str(e)) for e in raised] == [(ValueError, want)] * N


def test_init_dynamic_sets_the_variable_for_later_inits(monkeypatch):
    """Horovod's behaviour: init(process_sets="dynamic") sets HOROVOD_DYNAMIC_PROCESS_SETS, so
    an init() after shutdown() (or an elastic reset) stays dynamic."""
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "0")  # restored after the test
    hvd.init(process_sets="dynamic")
    try:
        assert os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "1"
    finally:
        hvd.shutdown()
    hvd.init()
    try:
        assert current().dynamic_process_sets
    finally:
        hvd.shutdown()


@pytest.mark.timeout(60)
def test_a_queued_communicator_set_is_resolved_once(fake_mpi):
    """A rank that waits for the others' add_process_set works out its communicator's ranks
    once, not every cycle (each resolution makes MPI groups)."""
    calls = []
    translate = fake_mpi.Group.Translate_ranks
    fake_mpi.Group.Translate_ranks = lambda *a: calls.append(1) or translate(*a)
    comm = FakeComm([0, 1, 2])

    def body(rank):
        if rank == 0:
            ps = hvd.add_process_set(hvd.ProcessSet(comm))
        else:
            time.sleep(0.3)  # rank 0 waits many cycles for the others
            ps = hvd.add_process_set([0, 1, 2])
        return ps.ranks

    assert run_loopback(N, body, timeout=40, dynamic_process_sets=True) == [[0, 1, 2]] * N
    assert len(calls) == 1
