"""`collective.gradset.GradientSet` on its own: bits per round, agreement, fused chunks, joined
ranks, retirement, the per-step cycle and the registration check (no runtime)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from collective.errors import ShutdownError
from collective.gradset import GradientSet, _compare, _fingerprint
from collective.types import DataType, ReduceOp

F32, F16 = DataType.FLOAT32, DataType.FLOAT16


def _set(shapes, dtypes=None, device=0, n_names=None):
    dtypes = dtypes or [F32] * len(shapes)
    names = n_names or [f"allreduce.p{i}" for i in range(len(shapes))]
    return GradientSet(names, shapes, dtypes, device, ReduceOp.AVERAGE, 1.0, 1.0, 0.0)


def _all_ones(gs):
    return np.full(gs.nwords, np.uint64(2**64 - 1), dtype=np.uint64)


def test_submitted_members_become_bits_and_agreed_ones_leave():
    gs = _set([(4,)] * 70)  # two words
    assert gs.nwords == 2
    for i in (0, 3, 65):
        gs.submit(i, f"t{i}")
    assert gs.busy() and not gs.words(False).any()  # not taken yet
    gs.take(0.0)
    w = gs.words(False)
    assert int(w[0]) == 0b1001 and int(w[1]) == 0b10
    # Another rank has 3 and 65 only: those two run, 0 waits.
    other = np.array([0b1000, 0b10], dtype=np.uint64)
    chunks = gs.agree(w & other, False, 1 << 20)
    assert [c.indices for c in chunks] == [[3, 65]]
    assert gs.mask == 1 and gs.busy()
    assert chunks[0].response().names == ["allreduce.p3", "allreduce.p65"]
    assert chunks[0].response().sizes == [4, 4]


def test_chunks_follow_the_fusion_rules():
    big = (64 << 20) // 4
    gs = _set([(10,), (10,), (big,), (10,), (10,), (10,)], [F32, F32, F32, F32, F16, F16])
    for i in range(6):
        gs.submit(i, i)
    gs.take(0.0)
    chunks = gs.agree(_all_ones(gs), False, 1 << 30)
    # a large device member fuses as any other; a dtype change cuts
    assert [c.indices for c in chunks] == [[0, 1, 2, 3], [4, 5]]
    # threshold: 40 + 40 bytes > 60 cuts after each member
    gs2 = _set([(10,)] * 3)
    for i in range(3):
        gs2.submit(i, i)
    gs2.take(0.0)
    assert [c.indices for c in gs2.agree(_all_ones(gs2), False, 60)] == [[0], [1], [2]]
    # host sets fuse large members too
    gs3 = _set([(10,), (big,)], device=-1)
    for i in range(2):
        gs3.submit(i, i)
    gs3.take(0.0)
    assert [c.indices for c in gs3.agree(_all_ones(gs3), False, 1 << 30)] == [[0, 1]]


def test_a_joined_rank_offers_every_member_and_keeps_no_state():
    gs = _set([(4,)] * 3)
    assert int(gs.words(True)[0]) == 0b111
    chunks = gs.agree(np.array([0b101], dtype=np.uint64), True, 1 << 20)
    assert [c.indices for c in chunks] == [[0, 2]] and chunks[0].joined
    assert gs.mask == 0
    gs.ran(chunks[0], "done")  # zeros ran: this rank's own step is not advanced
    assert gs.completion is None and gs._left == 3


def test_a_rank_that_joins_mid_step_sends_what_it_submitted():
    gs = _set([(4,)] * 3)
    gs.submit(1, "t1")
    gs.take(0.0)
    (chunk,) = gs.agree(_all_ones(gs), True, 1 << 20)
    assert chunk.indices == [0, 1, 2] and chunk.joined and chunk.own == 0b010
    assert gs.mask == 0  # not offered again in a later round

    class Engine:
        def zeros(self, shape, dtype, device):
            return "zeros"
    entries = gs.entries(chunk, Engine(), None)
    assert [e.tensor for e in entries] == ["zeros", "t1", "zeros"]
    gs.ran(chunk, "done")
    assert gs.completion == "done" and gs._left == 2


def test_step_cycle_wait_and_next_step():
    gs = _set([(4,)] * 2, device=-1)
    gs.submit(0, "a")
    gs.submit(1, "b")
    with pytest.raises(ValueError, match="submitted twice"):
        gs.submit(1, "b")
    assert gs.partial()
    gs.take(0.0)
    (chunk,) = gs.agree(_all_ones(gs), False, 1 << 20)
    got = []
    t = threading.Thread(target=lambda: got.append(gs.wait()))
    t.start()
    gs.ran(chunk, "completion")
    t.join(5)
    assert got == ["completion"]
    assert not gs.partial() and gs.tensors == [None, None]
    gs.submit(0, "a2")  # the next step
    assert gs.partial()


def test_failure_reaches_the_waiter_and_every_later_wait():
    gs = _set([(4,)], device=-1)
    gs.submit(0, "a")
    gs.fail(ShutdownError())
    with pytest.raises(ShutdownError):
        gs.wait()
    with pytest.raises(ShutdownError):
        gs.wait()


def test_a_retired_set_offers_nothing_and_releases_its_tensors():
    gs = _set([(4,)] * 2)
    gs.submit(0, "a")
    gs.take(0.0)
    gs.retire()
    assert not gs.busy()
    assert not gs.words(False).any() and not gs.words(True).any()
    assert gs.agree(_all_ones(gs), False, 1 << 20) == []
    gs.submit(1, "b")
    gs.take(0.0)
    assert gs.tensors == [None, None] and gs.mask == 0


def test_stall_warning_names_the_waiting_gradients(caplog):
    # Checked after each round's agreement, as the shutdown below.
    import logging
    import time
    gs = GradientSet(["allreduce.a", "allreduce.b"], [(1,), (1,)], [F32, F32], -1,
                     ReduceOp.SUM, 1.0, 1.0, 5.0)
    gs.submit(1, "b")
    gs.take(time.monotonic() - 3.0)
    none = np.zeros(1, dtype="<u8")
    logger = logging.getLogger("horovod")
    logger.addHandler(caplog.handler)
    try:
        gs.agree(none, False, 1 << 20)
        assert "did not submit" not in caplog.text
        gs._since -= 3.0  # now waiting for 6 s
        gs.agree(none, False, 1 << 20)
        gs.agree(none, False, 1 << 20)  # once per stall
    finally:
        logger.removeHandler(caplog.handler)
    warned = {id(r): r.getMessage() for r in caplog.records}  # a record may come twice
    assert len(warned) == 1
    (text,) = warned.values()
    assert "did not submit gradients" in text
    assert "allreduce.b" in text and "allreduce.a" not in text


def test_stall_past_the_shutdown_time_asks_for_shutdown(caplog):
    # Checked after each round's agreement: only members that round left pending count.
    import logging
    import time

    def stalled_set(pending_for: float) -> GradientSet:
        gs = GradientSet(["allreduce.a", "allreduce.b"], [(1,), (1,)], [F32, F32], -1,
                         ReduceOp.SUM, 1.0, 1.0, 2.0, shutdown_time=4.0)
        gs.submit(0, "a")
        gs.take(time.monotonic() - pending_for)
        return gs

    none = np.zeros(1, dtype="<u8")
    logger = logging.getLogger("horovod")
    logger.addHandler(caplog.handler)
    try:
        early = stalled_set(3.0)
        assert early.agree(none, False, 1 << 20) == [] and not early.stalled
        late = stalled_set(4.5)
        assert late.agree(none, False, 1 << 20) == [] and late.stalled
        late.agree(none, False, 1 << 20)  # once
        # Agreed in the round that would have passed the limit: no shutdown.
        agreed = stalled_set(10.0)
        assert len(agreed.agree(_all_ones(agreed), False, 1 << 20)) == 1
        assert not agreed.stalled and agreed.mask == 0
    finally:
        logger.removeHandler(caplog.handler)
    errors = {r.getMessage() for r in caplog.records if r.levelno == logging.ERROR}
    assert len(errors) == 1
    (text,) = errors
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (4 s)" in text and "Will shutdown" in text
    assert "allreduce.a" in text and "allreduce.b" not in text


def test_registration_check_names_the_parameter_and_ranks():
    names = ["allreduce.w", "allreduce.b"]

    def prints(shapes):
        return np.array([len(shapes)] + [_fingerprint(n, s, F32, True, ReduceOp.AVERAGE, 1.0, 1.0)
                                         for n, s in zip(names, shapes)], dtype=np.uint64)
    a = prints([(3, 2), (3,)])
    b = prints([(3, 2), (4,)])
    assert _compare(np.concatenate([a, a, a]), a, names, [0, 1, 2], 1) == ""
    msg = _compare(np.concatenate([a, b, b]), a, names, [0, 1, 2], 0)
    assert msg == ("parameter 1 ('allreduce.b' on rank 0) has a different name, shape, dtype "
                   "or option on rank(s) [1, 2] than on rank 0")
    short = np.array([1, a[1]], dtype=np.uint64)
    assert _compare(np.concatenate([a, short]), a, names, [4, 6], 0) == (
        "rank 4 has 2 parameters with gradients, rank 6 has 1")


def test_retiring_while_a_round_is_in_flight_follows_what_the_round_sent():
    # The owner retires on its thread while the coordinator waits for the round's AND: the
    # bits were sent, so the agreed members still run (every rank runs the same chunks).
    gs = _set([(4,)] * 2)
    gs.submit(0, "a")
    gs.submit(1, "b")
    gs.take(0.0)
    sent = gs.words(False)
    gs.retire()
    assert [c.indices for c in gs.agree(sent, False, 1 << 20)] == [[0, 1]]
    # The next round sends nothing and agrees on nothing.
    gs.take(0.0)
    assert not gs.words(False).any()
    assert gs.agree(_all_ones(gs), False, 1 << 20) == []


def test_no_chunks_once_every_rank_has_joined():
    from collective.coordinator.negotiate import Negotiator

    class PS:
        members_joined = frozenset()
    gs = _set([(4,)] * 2)
    ps = PS()
    ps.sets = [gs]
    n = Negotiator.__new__(Negotiator)
    res = np.array([0b11, 1], dtype=np.uint64)  # all bits, and every rank joined
    assert n._agree_sets(ps, res, True, 1 << 20, None) == []
    res[-1] = 0  # some rank is still training: the joined rank runs zeros with it
    assert [c.indices for c in n._agree_sets(ps, res, True, 1 << 20, None)] == [[0, 1]]


def test_a_set_of_another_process_set_fails_where_a_member_waits_in_join():
    # Process set 1 (global ranks [3, 5]); rank 5 waits in the global join(), so it sends all
    # bits. Rank 3 submitted two members: they can never run, and both ranks fail the set in
    # the same round (rank 3's wait raises, naming them) and retire it.
    from collective.coordinator.negotiate import Negotiator
    from collective.errors import MismatchError

    class PS:
        id, ranks, members_joined = 1, [3, 5], frozenset({1})

        def __init__(self, rank, gs):
            self.rank, self.sets = rank, [gs]

    stepping, waiting = _set([(4,)] * 3), _set([(4,)] * 3)
    stepping.submit(0, "a")
    stepping.submit(2, "c")
    stepping.take(0.0)
    waiting.take(0.0)
    flags = np.zeros(1, dtype=np.uint64)
    res = np.concatenate([stepping.words(False) & waiting.words(True), flags])
    n = Negotiator.__new__(Negotiator)
    assert n._agree_sets(PS(0, stepping), res, False, 1 << 20, None) == []
    assert n._agree_sets(PS(1, waiting), res, True, 1 << 20, None) == []
    for gs in (stepping, waiting):
        assert gs.retired and gs.mask == 0
        with pytest.raises(MismatchError, match=(
                r"allreduce of gradient\(s\) 'allreduce.p0', 'allreduce.p2' on process set 1 "
                r"\(ranks \[3, 5\]\) cannot complete: rank\(s\) 5 called hvd.join\(\) .*"
                r"\(rank\(s\) 3 submitted them\)")):
            gs.wait()
    # Nothing submitted on the stepping rank yet: nothing fails, nothing runs.
    idle, joined = _set([(4,)] * 2), _set([(4,)] * 2)
    idle.take(0.0)
    res = np.concatenate([idle.words(False) & joined.words(True), flags])
    assert n._agree_sets(PS(0, idle), res, False, 1 << 20, None) == []
    assert n._agree_sets(PS(1, joined), res, True, 1 << 20, None) == []
    assert not idle.retired and not joined.retired and idle.error is None


class _Pool:
    """Stands in for the NCCL engine's ready-event pool: records what is given back."""

    def __init__(self):
        self.free = []

    def release(self, ev):
        self.free.append(ev)


@pytest.fixture
def pool():
    import collective.engines.device as device
    saved = device._ready_events
    p = _Pool()
    device.set_ready_events(p)
    yield p
    device.set_ready_events(saved)


class _Engine:
    def zeros(self, *args):
        return None


def test_events_the_engine_waited_on_are_not_given_back_again_by_a_retire(pool):
    gs = _set([(2,)] * 3)
    gs.submit(0, "a", 101)
    gs.submit(1, "b", 102)
    gs.take(0.0)
    for chunk in gs.agree(np.array([0b01], dtype=np.uint64), False, 1 << 20):
        for e in gs.entries(chunk, _Engine(), None):
            pool.release(e.ready_event)  # the NCCL engine, once its stream waited
    gs.retire()
    gs.take(1.0)
    assert sorted(pool.free) == [101, 102]  # 102 never ran: given back by the retire
    assert gs.new_bytes == 0 and not gs.busy()


def _reducer_with_members(monkeypatch, register):
    """A per-gradient GradientReducer over three CPU parameters whose gradient set comes from
    `register` and whose ordinary ops complete at once (no runtime)."""
    from collective import Handle, ReduceOp, adapter, global_process_set
    from frameworks.torch._reducer import GradientReducer
    import frameworks.torch as ft
    torch = pytest.importorskip("torch")
    r = GradientReducer(ft.Compression.none, ReduceOp.AVERAGE, (1.0, 1.0), global_process_set,
                        False, 1)
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    for i, p in enumerate(params):
        r.add(p, f"p{i}")
        p.grad = torch.ones(2)
    r.form_buckets(0)
    monkeypatch.setattr(adapter, "gradient_set", register)
    launched = []

    def launch(slot):
        launched.append(slot.name)
        slot.send = slot.param.grad
        slot.handle = Handle(slot.name)
        slot.handle._set_result(None)
    r._launch = launch
    return r, launched


def test_a_step_that_cannot_register_tries_once(monkeypatch):
    from collective.errors import MismatchError
    attempts = []

    def refused(*args, **kwargs):  # as while a rank is joined
        attempts.append(1)
        raise MismatchError("Allgather is not supported with Join at this time.")
    r, launched = _reducer_with_members(monkeypatch, refused)
    for step in range(2):
        for slot in r.members:
            slot.delay = 1
            r.on_grad(slot)
        r.synchronize()
        assert len(attempts) == step + 1  # one attempt per step, not per gradient
    assert launched == ["p0", "p1", "p2"] * 2 and len(r.members) == 3


def test_a_job_without_gradient_sets_falls_back_from_synchronize(monkeypatch):
    # Dynamic process sets: no set at all. Registration first tried inside synchronize (no
    # hook fired) must not try again for the next members.
    attempts = []
    r, launched = _reducer_with_members(monkeypatch, lambda *a, **k: attempts.append(1))
    r.synchronize()
    assert attempts == [1] and launched == ["p0", "p1", "p2"] and r.members == []
    r.synchronize()  # later steps: ordinary ops, no attempt
    assert attempts == [1] and launched == ["p0", "p1", "p2"] * 2


def test_a_set_retired_between_take_and_words_of_its_last_round_gives_back_its_events(pool):
    # The round that removes a set retired on every rank may be the one in whose take() it was
    # not yet retired on this rank (the owner retired between take() and words()). It leaves
    # ps.sets after that round, so no later take() would give back its tensors and events.
    from collective.coordinator.negotiate import Negotiator
    from collective.coordinator.state import ProcessSetState

    class PS:
        set_flags = ProcessSetState.set_flags
        members_joined = frozenset()

    gs = _set([(2,)] * 2)
    ps = PS()
    ps.sets = [gs]
    gs.submit(0, "a", 101)
    gs.take(0.0)  # this round's take: not retired yet
    gs.retire()  # the owner resets on its thread
    sent = np.concatenate([gs.words(False), ps.set_flags(False)])
    assert int(sent[-1]) == 0b10  # retired here; every other rank sent the same
    n = Negotiator.__new__(Negotiator)
    assert n._agree_sets(ps, sent, False, 1 << 20, None) == []
    assert ps.sets == []  # left the rounds: take() never runs for it again
    assert pool.free == [101] and gs.tensors == [None, None]


def test_registration_returns_only_after_its_check(monkeypatch):
    # The registration's allgather handle lets its waiter go before its callbacks run, and the
    # check (which adds the set, or finds the ranks' parameters differ) is such a callback: a
    # slow check (many parameters, many ranks) let `register` return a set that was never
    # added (its synchronize() then waited for ever) where the other rank raised.
    import time

    import collective as hvd
    from collective import adapter, gradset
    from collective._current import current
    from tests._spmd import run_loopback

    compare = gradset._compare

    def slow(*args):
        time.sleep(0.2)
        return compare(*args)
    monkeypatch.setattr(gradset, "_compare", slow)

    def body(rank):
        names = ["allreduce.a", "allreduce.b" if rank == 0 else "allreduce.c"]
        with pytest.raises(ValueError, match="differ"):
            adapter.gradient_set(names, [(2,), (3,)], [F32, F32], -1, hvd.global_process_set,
                                 ReduceOp.SUM, 1.0, 1.0)
        gs = adapter.gradient_set(["allreduce.a"], [(2,)], [F32], -1, hvd.global_process_set,
                                  ReduceOp.SUM, 1.0, 1.0)
        return gs in current().member_sets()[0].sets, current().member_sets()[0].set_count

    assert run_loopback(2, body) == [(True, 2), (True, 2)]


def test_a_dropped_optimizers_set_is_retired(monkeypatch):
    # A program that builds a new optimizer (e.g. every epoch) drops the old one: its set
    # leaves the rounds once every rank dropped it, instead of adding words to each round.
    import gc
    gs = _set([(2,)] * 3)
    r, _ = _reducer_with_members(monkeypatch, lambda *a, **k: gs)
    assert r._live_set() is gs and not gs.retired
    del r
    gc.collect()
    assert gs.retired


def test_a_retired_sets_pending_members_end_their_timeline_negotiation():
    # take() starts a NEGOTIATE span per member; a set retired mid-step left them open until
    # the name came back (one long bogus span) or the file closed.
    class Tl:
        def __init__(self):
            self.started, self.ended = [], []

        def negotiate_start(self, name, kind):
            self.started.append(name)

        def negotiate_end(self, name):
            self.ended.append(name)
    tl = Tl()
    gs = _set([(4,)] * 3)
    gs.submit(0, "a")
    gs.submit(2, "c")
    gs.take(0.0, tl)
    gs.retire()
    gs.take(1.0, tl)
    assert sorted(tl.ended) == sorted(tl.started) == ["allreduce.p0", "allreduce.p2"]
    gs.take(2.0, tl)  # nothing left to end
    assert len(tl.ended) == 2
