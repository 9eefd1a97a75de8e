"""The coordinator driven through the loopback engine: N threads act as N ranks in this process.

Two styles: `start=False` drives `run_cycle()` by hand on every rank in lockstep, so exactly
which path a cycle took (cache fast path = one AND allreduce, slow path = gather + bcast) and
what got fused is deterministic; `start=True` runs the real background threads (wake on
submit, join, stall warnings, shutdown).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np
import pytest

import collective as hvd
from collective.engines.base import ControlPlane
from collective.ops import _control_op
from collective._current import current, use_runtime
from collective.types import RequestType
from tests._spmd import LoopbackFailure, run_loopback

pytestmark = pytest.mark.timeout(60)


class CountingPlane(ControlPlane):
    """Wraps a control plane and counts negotiation calls by kind."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.global_ranks = inner.global_ranks
        self.calls = collections.Counter()

    def gather(self, data):
        self.calls["gather"] += 1
        return self.inner.gather(data)

    def bcast(self, data):
        self.calls["bcast"] += 1
        return self.inner.bcast(data)

    def allreduce_words(self, words, op):
        self.calls[f"words_{op}"] += 1
        return self.inner.allreduce_words(words, op)

    def allgather(self, data):
        self.calls["allgather"] += 1
        return self.inner.allgather(data)

    def barrier(self):
        self.calls["barrier"] += 1
        return self.inner.barrier()

    def split(self, ranks):
        return self.inner.split(ranks)

    def abort(self, reason=""):
        self.inner.abort(reason)

    def __getattr__(self, name):  # the loopback engine's data exchange
        return getattr(self.inner, name)


def plane():
    return current().member_sets()[0].control


def count_engine_calls(method="_allreduce"):
    eng = current().member_sets()[0].host_engine
    calls = []
    orig = getattr(eng, method)

    def wrapped(*a, **kw):
        calls.append(a)
        return orig(*a, **kw)

    setattr(eng, method, wrapped)
    return calls


def cycle(times=1):
    for _ in range(times):
        assert current().coordinator.run_cycle()


# -- fast path vs slow path --------------------------------------------------------------------
def test_first_op_takes_slow_path_then_cache_fast_path():
    def body(rank):
        p = plane()
        x = np.full(4, rank + 1.0)
        h = hvd.allreduce_async(x, op=hvd.Sum, name="x")
        cycle()
        assert h.done(), "a name every rank submitted must finish in one cycle"
        np.testing.assert_allclose(h.wait(0), np.full(4, 6.0))
        assert p.calls["gather"] == 1 and p.calls["bcast"] == 1
        before = dict(p.calls)
        for step in range(5):
            h = hvd.allreduce_async(x * step, op=hvd.Sum, name="x")
            cycle()
            assert h.done()
            np.testing.assert_allclose(h.wait(0), np.full(4, 6.0 * step))
        assert p.calls["gather"] == before["gather"], "cached op went through the slow path"
        assert p.calls["bcast"] == before["bcast"]
        assert p.calls["words_and"] == before["words_and"] + 5
        return True

    assert run_loopback(3, body, start=False, control=CountingPlane) == [True] * 3


def test_cache_disabled_always_takes_slow_path():
    def body(rank):
        p = plane()
        for _ in range(4):
            h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="x")
            cycle()
            assert h.done()
        assert p.calls["gather"] == 4
        return True

    run_loopback(2, body, start=False, control=CountingPlane, cache_capacity=0)


def test_cached_hit_waits_for_slow_ranks_without_slow_path():
    def body(rank):
        p = plane()
        h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="x")
        cycle()
        h.wait(0)
        gathers = p.calls["gather"]
        h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="x") if rank == 0 else None
        cycle(3)  # rank 1 has not submitted yet: nothing completes
        if h is not None:
            assert not h.done()
        if rank == 1:
            h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="x")
        cycle()
        np.testing.assert_allclose(h.wait(0), np.full(2, 2.0))
        assert p.calls["gather"] == gathers
        return True

    run_loopback(2, body, start=False, control=CountingPlane)


def test_invalid_cache_entry_renegotiates_everywhere():
    def body(rank):
        p = plane()
        hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="x")
        cycle()
        # Same name, new shape: INVALID on every rank -> OR allreduce, erase, slow path.
        h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="x")
        cycle(2)
        np.testing.assert_allclose(h.wait(0), np.full(3, 2.0))
        assert p.calls["words_or"] >= 1
        # And the new signature is cached again.
        g = p.calls["gather"]
        h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="x")
        cycle()
        h.wait(0)
        assert p.calls["gather"] == g
        return True

    run_loopback(2, body, start=False, control=CountingPlane)


# -- fusion --------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold,expected_calls", [(128 * 1024 * 1024, 1), (0, 10)])
def test_ready_tensors_fuse_into_one_engine_call(threshold, expected_calls):
    def body(rank):
        calls = count_engine_calls()
        for rnd in range(2):  # slow path, then cache fast path
            del calls[:]
            hs = [hvd.allreduce_async(np.full(i + 1, float(rank + i)), op=hvd.Sum,
                                      name=f"t{i}") for i in range(10)]
            cycle()
            assert all(h.done() for h in hs)
            for i, h in enumerate(hs):
                np.testing.assert_allclose(h.wait(0), np.full(i + 1, 1.0 + 2 * i))
            assert len(calls) == expected_calls, f"round {rnd}: {len(calls)} engine calls"
        return True

    run_loopback(2, body, start=False, fusion_threshold=threshold)


def test_fusion_respects_threshold_bytes():
    def body(rank):
        calls = count_engine_calls()
        hs = [hvd.allreduce_async(np.ones(16, dtype=np.float32), op=hvd.Sum, name=f"t{i}")
              for i in range(6)]
        cycle()
        assert all(h.done() for h in hs)
        # 64 B each, 128 B threshold: two per batch.
        assert [c[0].size for c in calls] == [32, 32, 32]
        return True

    run_loopback(2, body, start=False, fusion_threshold=128)


def test_mixed_dtypes_fuse_per_dtype():
    def body(rank):
        calls = count_engine_calls()
        hs = [hvd.allreduce_async(np.ones(4, dtype=np.float32 if i % 2 else np.float64),
                                  op=hvd.Sum, name=f"t{i}") for i in range(6)]
        cycle()
        for h in hs:
            np.testing.assert_allclose(h.wait(0), np.full(4, 2.0))
        assert sorted(c[0].dtype.name for c in calls) == ["float32", "float64"]
        return True

    run_loopback(2, body, start=False)


def test_grouped_allreduce_is_one_engine_call_with_background_thread():
    def body(rank):
        calls = count_engine_calls()
        outs = hvd.grouped_allreduce([np.ones(3), np.ones(5), np.ones(7)], op=hvd.Sum,
                                     name="grp")
        for o in outs:
            np.testing.assert_allclose(o, np.full(o.shape, 2.0))
        assert len(calls) == 1
        return True

    run_loopback(2, body)


def test_disable_group_fusion_keeps_groups_apart():
    def body(rank):
        calls = count_engine_calls()
        h1 = hvd.grouped_allreduce_async([np.ones(3), np.ones(3)], op=hvd.Sum, name="g1")
        h2 = hvd.grouped_allreduce_async([np.ones(3), np.ones(3)], op=hvd.Sum, name="g2")
        cycle()
        h1.wait(0), h2.wait(0)
        assert len(calls) == 2, f"{len(calls)} engine calls"
        return True

    run_loopback(2, body, start=False, disable_group_fusion=True)


# -- background thread ---------------------------------------------------------------------------
def test_lone_op_wakes_the_coordinator_instead_of_waiting_a_cycle():
    def body(rank):
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="warm")
        time.sleep(0.3)  # both coordinators now sleep in their 5 s cycle wait
        t0 = time.monotonic()
        for i in range(5):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"lone{i}")
        return (time.monotonic() - t0) / 5

    per_op = run_loopback(2, body, cycle_time_ms=5000.0)
    assert max(per_op) < 0.5, f"a lone allreduce took {max(per_op):.3f} s with a 5 s cycle"


def test_async_ops_from_many_user_threads():
    def body(rank):
        out = {}
        rt = current()

        def worker(k):
            with use_runtime(rt):  # loopback: the rank's runtime is thread-local
                out[k] = hvd.allreduce(np.full(3, float(k)), op=hvd.Sum, name=f"w{k}")

        ts = [threading.Thread(target=worker, args=(k,), name=f"user-{k}") for k in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        for k in range(8):
            np.testing.assert_allclose(out[k], np.full(3, 3.0 * k))
        return True

    run_loopback(3, body)


def test_every_op_through_loopback():
    def body(rank):
        n = 3
        np.testing.assert_allclose(hvd.allreduce(np.full(2, rank + 1.0), name="ar"),
                                   np.full(2, 2.0))  # Average by default
        g = hvd.allgather(np.full((rank + 1, 2), rank), name="ag")
        np.testing.assert_array_equal(g, np.concatenate([np.full((r + 1, 2), r)
                                                         for r in range(n)]))
        b = hvd.broadcast(np.full(3, rank), root_rank=2, name="bc")
        np.testing.assert_array_equal(b, np.full(3, 2))
        out, recv = hvd.alltoall(np.arange(n) + 10 * rank, splits=np.ones(n, np.int32),
                                 name="a2a")
        np.testing.assert_array_equal(out, [10 * r + rank for r in range(n)])
        np.testing.assert_array_equal(recv, np.ones(n))
        rs = hvd.reducescatter(np.ones((4, 2)), op=hvd.Sum, name="rs")
        assert rs.shape == ((2, 2) if rank == 0 else (1, 2))
        hvd.barrier()
        return hvd.rank(), hvd.size()

    assert run_loopback(3, body) == [(0, 3), (1, 3), (2, 3)]


def test_mismatch_fails_every_rank():
    def body(rank):
        with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE tensor shapes"):
            hvd.allreduce(np.ones(rank + 1), name="bad")
        np.testing.assert_allclose(hvd.allreduce(np.ones(1), op=hvd.Sum, name="good"),
                                   np.full(1, 3.0))
        return True

    run_loopback(3, body)


def _group_size_mismatch(rank: int) -> tuple[str, list[str]]:
    # Step 1 caches the three-tensor group "g" on both ranks; at step 2 rank 1 passes two
    # tensors: rank 0's members (some or all of them cache hits) and rank 1's (new names)
    # must fail on both ranks, leaving nothing pending. Cycles run here (start=False), one
    # round at a time on both ranks.
    coord = current().coordinator
    ts = [np.ones(2), np.ones(3), np.ones(4)]
    h = hvd.grouped_allreduce_async(ts, op=hvd.Sum, name="g")
    assert coord.run_cycle()
    for out in h.wait(0):
        np.testing.assert_allclose(out, 2.0)
    h = hvd.grouped_allreduce_async(ts if rank == 0 else ts[:2], op=hvd.Sum, name="g")
    ps = current().member_sets()[0]
    for _ in range(30):  # 1.5 s: waiting cache hits reach the slow path after 1 s
        assert coord.run_cycle()
        time.sleep(0.05)
    with pytest.raises(hvd.HorovodInternalError) as info:
        h.wait(0)
    return str(info.value), sorted(ps.table) + [str(b) for b in ps.hits._by_bit]


@pytest.mark.parametrize("config", [{"cache_capacity": 2}, {"stall_check_disable": True}],
                         ids=["some-members-cached", "stall-check-off"])
def test_group_size_mismatch_with_cached_members_fails_every_member(config):
    # some-members-cached: a cache of two evicted the first member at step 1, so rank 0's
    # step-2 group is split between a new request and two cache hits; the error fails the
    # hits too (they waited for ever). stall-check-off: all of rank 0's members are cache
    # hits, which reach rank 0's message table (and meet rank 1's other names) after 1 s
    # also without the stall check (they never did).
    for text, pending in run_loopback(2, _group_size_mismatch, start=False, timeout=20,
                                      **config):
        assert text.startswith("Mismatched grouped allreduce sizes: rank(s) 1 passed 2 tensors; "
                               "rank(s) 0 passed 3 tensors"), text
        assert pending == []


def test_an_op_failed_by_an_error_before_its_request_was_sent_is_not_sent_later():
    # Rank 0 submits a second group "g" while the round that fails its first is in flight
    # (after its queue was drained, before the error response runs): the error names it too,
    # so its request must not go to rank 0's table in a later round, where it would meet rank
    # 1's next group "g" with no entry here (zeros in rank 1's sum, then caches that differ).
    box: dict = {}

    def body(rank):
        rt = current()
        ps = rt.member_sets()[0]
        if rank == 1:
            with pytest.raises(hvd.HorovodInternalError, match="Mismatched grouped"):
                hvd.synchronize(hvd.grouped_allreduce_async([np.full(2, 1.0)] * 3, name="g",
                                                            op=hvd.Sum))
            box["rank1_failed"] = True
            while not box.get("rank0_failed"):
                time.sleep(0.01)
            h = hvd.grouped_allreduce_async([np.full(2, 10.0)] * 3, name="g", op=hvd.Sum)
            box["rank1_next"] = True
            return [a.tolist() for a in hvd.synchronize(h)]
        time.sleep(0.3)  # rank 1's three-tensor group waits in rank 0's table
        bcast = ps.control.bcast

        def submit_during_the_round(payload):
            if "late" not in box:
                with use_runtime(rt):
                    box["late"] = hvd.grouped_allreduce_async([np.full(2, 5.0)] * 3,
                                                              name="g", op=hvd.Sum)
            return bcast(payload)
        ps.control.bcast = submit_during_the_round
        with pytest.raises(hvd.HorovodInternalError, match="Mismatched grouped"):
            hvd.synchronize(hvd.grouped_allreduce_async([np.full(2, 1.0)] * 2, name="g",
                                                        op=hvd.Sum))
        with pytest.raises(hvd.HorovodInternalError, match="Mismatched grouped"):
            hvd.synchronize(box["late"])
        ps.control.bcast = bcast
        while not box.get("rank1_failed"):
            time.sleep(0.01)
        box["rank0_failed"] = True
        while not box.get("rank1_next"):
            time.sleep(0.01)
        time.sleep(0.3)  # rank 1's next group "g" reaches rank 0's table first
        h = hvd.grouped_allreduce_async([np.full(2, 5.0)] * 3, name="g", op=hvd.Sum)
        return [a.tolist() for a in hvd.synchronize(h)]

    for got in run_loopback(2, body, timeout=15):
        assert got == [[15.0, 15.0]] * 3, got


def test_a_synchronous_op_after_the_loop_ended_fails_instead_of_starting_a_round(monkeypatch):
    # Rank 1 shuts down; rank 0's coordinator thread agrees on it and its loop ends. A
    # synchronous op on rank 0 between the loop's end and `stopped` (widened here: autotune's
    # close, which runs after the pending ops were failed, takes a second) must not start an
    # express round with the stopped peer (nobody would ever complete its handle).
    from collective.coordinator import tuning
    close = tuning.Tuning.close

    def slow_close(self):
        time.sleep(1.0)
        return close(self)
    monkeypatch.setattr(tuning.Tuning, "close", slow_close)

    def body(rank):
        x = np.ones(4, dtype=np.float32)
        for _ in range(3):
            hvd.allreduce(x, name="a")  # cached after the first: the express lane
        if rank == 1:
            return None
        time.sleep(0.3)  # rank 0's coordinator thread runs the shutdown round
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(x, name="a")
        return None

    run_loopback(2, body, timeout=15, world_timeout=3)


def test_duplicate_name_raises_value_error_at_enqueue():
    def body(rank):
        h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="dup")
        with pytest.raises(ValueError, match="allreduce.dup"):
            hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="dup")
        cycle()
        h.wait(0)
        h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="dup")  # free again
        cycle()
        return h.wait(0)[0]

    assert run_loopback(2, body, start=False) == [2.0, 2.0]


def test_a_name_over_the_wire_limit_raises_value_error_at_enqueue():
    # Names travel in every negotiation round, limited to wire.MAX_STR_BYTES (1 MiB) each; a
    # longer one is refused where it is submitted instead of ending the job in the coordinator.
    def body(rank):
        for name in ("x" * (1 << 20), "\u00e9" * (1 << 19)):  # with the prefix, over 1 MiB
            # The name shown by its start and its length in bytes, prefix included.
            n = len(name.encode()) + len("allreduce.")
            with pytest.raises(ValueError, match=rf"\.\.\. \({n} bytes\) is too long: names "
                                                 r"are limited to 1048576 bytes"):
                hvd.allreduce(np.ones(1), name=name)
            with pytest.raises(ValueError, match=r"is too long: names are limited to 1048576"):
                hvd.grouped_allreduce_async([np.ones(1)], name=name)
        longest = "x" * ((1 << 20) - len("allreduce."))
        return hvd.allreduce(np.ones(1), op=hvd.Sum, name=longest)[0]

    assert run_loopback(2, body) == [2.0, 2.0]


# -- join --------------------------------------------------------------------------------------
def test_join_zeros_average_full_size_and_last_rank():
    def body(rank):
        results = []
        for step in range(rank + 1):  # rank r does r + 1 steps
            results.append(hvd.allreduce(np.full(2, rank + 1.0), op=hvd.Average, name="j"))
        last = hvd.join()
        return results, last

    out = run_loopback(3, body)
    assert [last for _, last in out] == [2, 2, 2]
    for rank, (results, _) in enumerate(out):
        for step, got in enumerate(results):
            active = [r for r in range(3) if r >= step]
            np.testing.assert_allclose(got, np.full(2, sum(r + 1 for r in active) / 3.0))


def test_join_with_cached_tensor_and_manual_cycles():
    """Rank 0 joins while rank 1 submits a name that is already in the response cache."""
    def join_async():
        return _control_op(RequestType.JOIN, "join.noname", hvd.global_process_set)

    def body(rank):
        h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="c")
        cycle()
        h.wait(0)  # "c" is cached on every rank now
        if rank == 0:
            j = join_async()
            cycle(6)
            assert not j.done()  # rank 1 has not joined yet
        else:
            h = hvd.allreduce_async(np.full(2, 5.0), op=hvd.Sum, name="c")
            cycle(6)
            np.testing.assert_allclose(h.wait(0), np.full(2, 5.0))  # rank 0 gave zeros
            j = join_async()
        cycle(4)
        last = j.wait(0)
        # After the join the cache works again for both ranks.
        h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="c")
        cycle(3)
        np.testing.assert_allclose(h.wait(0), np.full(2, 2.0))
        return last

    assert run_loopback(2, body, start=False) == [1, 1]


# -- stall inspector -----------------------------------------------------------------------------
def test_stall_warning_names_missing_ranks(horovod_log):
    def body(rank):
        if rank < 2:
            h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="stalled")
        time.sleep(1.0)
        if rank == 2:
            h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="stalled")
        return h.wait(10)[0]

    assert run_loopback(3, body, stall_check_time=0.2) == [3.0] * 3
    text = horovod_log.text()
    assert "One or more tensors were submitted to be reduced, gathered or broadcasted by " \
           "subset of ranks and are waiting for remainder of ranks for more than 0.2 " \
           "seconds." in text
    assert "Missing ranks:\n2: [allreduce.stalled]" in text
    assert all(r.levelno == logging.WARNING for r in horovod_log.records
               if "Missing ranks" in r.getMessage())


def test_stall_warning_for_cached_tensor(horovod_log):
    def body(rank):
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="cached_stall")  # cache it
        if rank == 0:
            time.sleep(1.0)
        return hvd.allreduce(np.ones(1), op=hvd.Sum, name="cached_stall")[0]

    assert run_loopback(2, body, stall_check_time=0.2) == [2.0, 2.0]
    assert "Missing ranks:\n0: [allreduce.cached_stall]" in horovod_log.text()


def test_stall_shutdown_fails_pending_ops(horovod_log):
    def body(rank):
        if rank == 1:
            time.sleep(1.5)  # never submits
            return "absent"
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="forever")
        return "failed"

    assert run_loopback(2, body, stall_check_time=0.2,
                        stall_shutdown_time=0.5) == ["failed", "absent"]
    errors = [r for r in horovod_log.records if "Will shutdown" in r.getMessage()]
    assert errors and errors[0].levelno == logging.ERROR
    assert "1!: [allreduce.forever]" in errors[0].getMessage()


def test_stall_check_disabled(horovod_log):
    def body(rank):
        if rank == 1:
            time.sleep(0.8)
        return hvd.allreduce(np.ones(1), op=hvd.Sum, name="slow")[0]

    run_loopback(2, body, stall_check_time=0.1, stall_check_disable=True)
    assert "Missing ranks" not in horovod_log.text()


# -- shutdown -----------------------------------------------------------------------------------
def test_one_rank_shutdown_fails_others_pending_and_new_ops():
    def body(rank):
        rt = current()
        if rank == 1:
            time.sleep(0.3)
            rt.shutdown()
            return "left"
        h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="orphan")
        t0 = time.monotonic()
        with pytest.raises(hvd.ShutdownError) as info:
            h.wait(10)
        assert time.monotonic() - t0 < 3.0
        assert "Horovod has been shut down" in str(info.value)
        with pytest.raises(hvd.ShutdownError):
            hvd.allreduce_async(np.ones(1), name="after")
        return "failed"

    assert run_loopback(2, body) == ["failed", "left"]


def test_engine_exception_fails_everything_with_the_cause(horovod_log):
    def body(rank):
        if rank == 0:
            eng = current().member_sets()[0].host_engine

            def broken(*a, **kw):
                raise RuntimeError("injected engine failure")

            eng._allreduce = broken
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="boom")
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="later")
        return True

    run_loopback(2, body, world_timeout=5.0)
    assert "Horovod background loop uncaught exception: injected engine failure" in \
        horovod_log.text()


def test_run_loopback_reports_a_failing_rank():
    def body(rank):
        if rank == 1:
            raise KeyError("rank one broke")
        return hvd.allreduce(np.ones(1), name="x")

    with pytest.raises(LoopbackFailure, match="rank 1 raised first: KeyError"):
        run_loopback(2, body, timeout=20)


def test_runtime_restarts_in_loopback():
    for _ in range(3):
        assert run_loopback(2, lambda r: hvd.allreduce(np.ones(1), op=hvd.Sum,
                                                       name="again")[0]) == [2.0, 2.0]


def test_single_mode_init_shutdown_init():
    assert not hvd.is_initialized()
    for _ in range(3):
        hvd.init()
        try:
            hvd.init()  # idempotent
            assert hvd.size() == 1 and hvd.rank() == 0 and hvd.mode() == "single"
            np.testing.assert_allclose(hvd.allreduce(np.arange(3.0)), np.arange(3.0))
            np.testing.assert_allclose(hvd.allreduce(np.arange(3.0), op=hvd.Sum,
                                                     prescale_factor=2.0), 2 * np.arange(3.0))
            assert hvd.join() == 0
        finally:
            hvd.shutdown()
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use "
                                             r"hvd\.init\(\)\.$"):
            hvd.rank()


def test_cache_eviction_warning_logged_once(horovod_log):
    def body(rank):
        for i in range(6):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"e{i}")
        for i in range(6):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"e{i}")
        return True

    run_loopback(2, body, cache_capacity=2)
    warnings = [r for r in horovod_log.records
                if "A response has been evicted from cache" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # once per process (here: per rank runtime at most)
    # Horovod's text names the capacity in force, not the default.
    assert all(r.getMessage().endswith("(HOROVOD_CACHE_CAPACITY>2).") for r in warnings)


# -- cycles driven by the thread that waits (Coordinator.drive) ---------------------------------
def _perform_threads():
    """Records the name of the thread that executes each response."""
    coord = current().coordinator
    names = []
    orig = coord._perform

    def wrapped(ps, resp):
        names.append(threading.current_thread().name)
        return orig(ps, resp)

    coord._perform = wrapped
    return names


def test_synchronous_op_runs_its_cycle_on_the_calling_thread():
    def body(rank):
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="warm-up")  # past the threads' first cycles
        time.sleep(0.2)
        names = _perform_threads()
        for i in range(5):
            np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"s{i}"),
                                       np.full(2, 2.0))
        return names

    # With a 5 s cycle the coordinator thread only wakes when a submit asks it to; the
    # synchronous calls run their ops themselves, so every response runs on the caller's thread.
    for names in run_loopback(2, body, cycle_time_ms=5000.0):
        assert len(names) == 5
        assert "hvd-coordinator" not in names, names


def test_error_in_a_driven_cycle_ends_the_job_on_the_coordinator_thread(horovod_log):
    def body(rank):
        rt = current()
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="warm-up")
        time.sleep(0.2)
        failed_on = []
        if rank == 0:
            def broken(*a, **kw):
                failed_on.append(threading.current_thread().name)
                raise RuntimeError("injected failure in a driven cycle")

            rt.member_sets()[0].host_engine._allreduce = broken
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="boom")
        assert rt.coordinator.stopped.wait(10), "the coordinator thread did not stop"
        with pytest.raises((hvd.HorovodInternalError, hvd.ShutdownError)):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="later")
        return failed_on, threading.current_thread().name

    (failed_on, caller), _ = run_loopback(2, body, world_timeout=5.0, cycle_time_ms=5000.0)
    assert failed_on == [caller], failed_on  # the failing cycle ran on the caller's thread
    assert "uncaught exception: injected failure in a driven cycle" in horovod_log.text()


def test_shutdown_agreed_in_a_driven_cycle_stops_the_coordinator():
    def body(rank):
        rt = current()
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="warm-up")  # past the threads' first cycles
        if rank == 1:
            time.sleep(0.5)
            rt.shutdown()
            return "left"
        time.sleep(0.2)
        with pytest.raises(hvd.ShutdownError):
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="orphan")  # drives the final cycle
        assert rt.coordinator.stopped.wait(10)
        assert rt.coordinator._ended_by_driver, "the shutdown was not agreed in a driven cycle"
        return "failed"

    assert run_loopback(2, body, cycle_time_ms=5000.0) == ["failed", "left"]


def test_a_synchronous_cached_op_costs_one_negotiation_round():
    # The latency of a lone op is mostly rounds and thread hand-offs: a cached synchronous op
    # must take exactly one round (no empty round after it, none for a spurious wake-up).
    def body(rank):
        p = plane()
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="c")  # slow path once, then cached
        time.sleep(0.2)
        before = p.calls["words_and"]
        for _ in range(10):
            hvd.allreduce(np.ones(2), op=hvd.Sum, name="c")
        time.sleep(0.2)  # any trailing round would happen now
        return p.calls["words_and"] - before

    assert run_loopback(2, body, control=CountingPlane, cycle_time_ms=5000.0) == [10, 10]


def test_large_new_host_outputs_are_left_to_the_coordinator_thread():
    # On the main thread glibc returns each freed output to the OS, so a driven cycle that
    # allocates a large host output would page-fault it in again every time.
    def body(rank):
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="warm-up")
        time.sleep(0.2)
        names = _perform_threads()
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="small")  # driven
        big = np.ones(64 * 1024, dtype=np.float32)  # 256 KiB, new output
        hvd.allreduce(big, op=hvd.Sum, name="big")
        hvd.allreduce(big, op=hvd.Sum, name="big")  # cached now: still not the express lane
        hvd.allreduce_(big, op=hvd.Sum, name="big-inplace")  # no allocation: driven
        return names

    for names in run_loopback(2, body, cycle_time_ms=5000.0):
        assert names[0] != "hvd-coordinator" and names[3] != "hvd-coordinator", names
        assert names[1] == names[2] == "hvd-coordinator", names


def test_keyboard_interrupt_in_a_driven_cycle_reaches_the_caller_and_ends_the_job():
    def body(rank):
        rt = current()
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="warm-up")
        time.sleep(0.2)
        if rank == 0:
            def interrupted(*a, **kw):
                raise KeyboardInterrupt

            rt.member_sets()[0].host_engine._allreduce = interrupted
            with pytest.raises(KeyboardInterrupt):
                hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
        else:
            with pytest.raises((hvd.HorovodInternalError, hvd.ShutdownError)):
                hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
        assert rt.coordinator.stopped.wait(10), "the coordinator thread did not stop"
        return True

    run_loopback(2, body, world_timeout=5.0, cycle_time_ms=5000.0)


def test_an_op_queued_by_a_failing_synchronous_start_still_runs():
    # Inside a synchronous function the first op is queued without waking the coordinator
    # thread (the caller runs the cycle); if the function then fails, the queued op must not
    # wait for the next idle round (5 s here).
    from collective.ops import wait_now

    def body(rank):
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="warm-up")
        time.sleep(0.2)
        box = {}

        def start():
            box["h"] = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="queued-meanwhile")
            raise ValueError("this submit failed")

        with pytest.raises(ValueError):
            wait_now(hvd.synchronize, start)
        np.testing.assert_allclose(box["h"].wait(2.0), [2.0])
        return True

    assert run_loopback(2, body, cycle_time_ms=5000.0) == [True, True]



# -- the express lane (Coordinator.express) ---------------------------------------------------
def _count_cycles():
    coord = current().coordinator
    counts = collections.Counter()
    orig_cycle, orig_express = coord.run_cycle, coord._express_round

    def run_cycle():
        counts[threading.current_thread().name] += 1
        return orig_cycle()

    def express_round(*a):
        counts["express"] += 1
        return orig_express(*a)

    coord.run_cycle, coord._express_round = run_cycle, express_round
    return counts


def test_a_lone_cached_synchronous_op_runs_in_the_express_lane():
    # No cycle at all: one round inside the caller's enqueue, and the op ran on the caller.
    def body(rank):
        p = plane()
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="c")  # slow path once, then cached
        time.sleep(0.2)
        counts = _count_cycles()
        names = _perform_threads()
        before = p.calls["words_and"]
        for i in range(10):
            np.testing.assert_allclose(hvd.allreduce(np.full(2, float(i)), op=hvd.Sum,
                                                     name="c"), np.full(2, 2.0 * i))
        out = np.ones(3)
        hvd.allreduce_(np.ones(2), op=hvd.Sum, name="c")  # in place, same signature
        hvd.allreduce(out, op=hvd.Sum, name="d")  # a new name: not cached, ordinary cycle
        return dict(counts), names, p.calls["words_and"] - before

    for counts, names, rounds in run_loopback(2, body, control=CountingPlane,
                                              cycle_time_ms=5000.0):
        assert counts["express"] == 11, counts
        assert rounds == 12, rounds  # 11 express rounds, 1 for "d" (its slow path is gather)
        assert "hvd-coordinator" not in names, names


def test_express_lane_meeting_a_round_without_the_op_waits_as_a_cache_hit():
    # Rank 1 arrives late; rank 0's express round meets rank 1's idle rounds (no bit), so
    # rank 0's op waits as an ordinary cache hit and completes when rank 1 submits. A rank
    # whose coordinator is inside an idle round at the call takes no express lane (the cycle
    # lock is held): the scene is then played again, up to five times.
    def body(rank):
        coord = current().coordinator
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="late")
        counts = _count_cycles()
        for _ in range(5):
            time.sleep(0.2)
            rounds, waits = coord.express_rounds, coord.express_waits
            cycles = counts["hvd-coordinator"]
            if rank == 1:
                time.sleep(0.4)  # several idle rounds (50 ms each) pass meanwhile
            out = hvd.allreduce(np.full(2, float(rank + 1)), op=hvd.Sum, name="late")
            np.testing.assert_allclose(out, [3.0, 3.0])
            seen = (coord.express_rounds - rounds, coord.express_waits - waits,
                    counts["hvd-coordinator"] - cycles)
            # Played as meant on both ranks: rank 0 waited after its express round, rank 1's
            # express round ran the op at once.
            played = seen[:2] == ((1, 1) if rank == 0 else (1, 0))
            if hvd.allreduce(np.array([float(played)]), op=hvd.Min, name="played")[0]:
                return seen
        raise AssertionError(f"rank {rank}: the express lane was never taken as meant: {seen}")

    (r0, w0, cycles0), (r1, w1, _) = run_loopback(2, body, cycle_time_ms=1.0)
    assert (r0, w0) == (1, 1) and cycles0 >= 1, (r0, w0, cycles0)
    assert (r1, w1) == (1, 0), (r1, w1)


def test_express_lane_with_a_mismatched_peer_fails_both_ranks():
    # Rank 0 takes the express lane for a cached name; rank 1 sends the same name with another
    # shape (a cache miss there): the round turns into the slow path and both ranks fail.
    def body(rank):
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="m")
        time.sleep(0.2)
        counts = _count_cycles()
        with pytest.raises(hvd.HorovodInternalError, match="m"):
            hvd.allreduce(np.ones(2 + rank), op=hvd.Sum, name="m")
        # the job goes on: the next cached op works again
        np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="m2"), [2, 2])
        return dict(counts)

    c0, _ = run_loopback(2, body, cycle_time_ms=5000.0)
    assert c0["express"] == 1, c0


def test_a_synchronous_function_inside_another_keeps_the_outer_ones_lane():
    # wait_now inside wait_now (a synchronous helper that itself calls a synchronous op first):
    # each one's op takes the express lane and each returns its own result.
    from collective.ops import wait_now

    def body(rank):
        coord = current().coordinator
        for name in ("inner", "outer"):
            hvd.allreduce(np.ones(2), op=hvd.Sum, name=name)  # cache both names
        time.sleep(0.2)
        before = coord.express_rounds

        def start():
            inner = hvd.allreduce(np.full(2, 3.0), op=hvd.Sum, name="inner")
            np.testing.assert_allclose(inner, [6.0, 6.0])
            return hvd.allreduce_async(np.full(2, 5.0), op=hvd.Sum, name="outer")

        np.testing.assert_allclose(wait_now(hvd.synchronize, start), [10.0, 10.0])
        return coord.express_rounds - before

    assert run_loopback(2, body, cycle_time_ms=5000.0) == [2, 2]


def test_synchronous_op_behind_a_pending_async_op_is_queued_and_driven():
    # The express lane needs an empty table: with an async op of this rank still pending (its
    # peer submits late), a synchronous op is queued instead and the caller drives the cycle;
    # reusing the pending op's name there is refused at once, naming it.
    def body(rank):
        coord = current().coordinator
        for name in ("late", "now"):
            hvd.allreduce(np.ones(2), op=hvd.Sum, name=name)  # both cached
        time.sleep(0.2)
        before = coord.express_rounds
        if rank == 1:
            time.sleep(0.3)
        h = hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, name="late")
        if rank == 0:
            with pytest.raises(hvd.DuplicateNameError, match="allreduce.late"):
                hvd.allreduce(np.ones(2), op=hvd.Sum, name="late")
        out = hvd.allreduce(np.full(2, 2.0), op=hvd.Sum, name="now")
        np.testing.assert_allclose(out, [4.0, 4.0])
        np.testing.assert_allclose(h.wait(10), [2.0, 2.0])
        return coord.express_rounds - before

    expressed = run_loopback(2, body, cycle_time_ms=5000.0)
    assert expressed[0] == 0, expressed  # rank 0's "now" waited behind its pending "late"
