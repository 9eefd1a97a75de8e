"""Autotune's switches in the coordinator (collective/coordinator/tuning.py), N threads as N
ranks through the loopback engine: the response cache turned off and on mid-run, with cache
hits waiting, through the express lane and on a second process set; and the bucket size of a
torch `DistributedOptimizer` re-planned on every rank at the same step while ranks run skewed.
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

import collective as hvd
from collective._current import current
from collective.autotune import Params
from tests._spmd import run_loopback
from tests.unit.test_coordinator import CountingPlane, cycle, plane

pytestmark = pytest.mark.timeout(120)


class FakeDriver:
    """Stands in for rank 0's autotune driver: publishes what the test asks for."""

    def __init__(self, base: Params) -> None:
        self.base = base
        self.pending = False
        self.next = base
        self.lock = threading.Lock()
        self.recorded = 0
        self.toggle_every = 0  # > 0: switch the cache after every so many recorded allreduces
        self.held = False  # hold_buckets() was called (a rank joined)

    def want(self, **changes) -> None:
        with self.lock:
            self.next = Params(**{**self.next.__dict__, **changes})
            self.pending = True

    def publish(self) -> bytes:
        with self.lock:
            self.pending = False
            return self.next.encode()

    def hold_buckets(self) -> None:
        self.held = True

    def close(self) -> None:  # the coordinator's loop ended
        pass

    def record(self, names, nbytes) -> None:
        self.recorded += 1
        if self.toggle_every and self.recorded % self.toggle_every == 0:
            self.want(cache_enabled=not self.next.cache_enabled)


def _install_fake(rank: int) -> FakeDriver | None:
    tuning = current().coordinator.tuning
    cfg = current().config
    if rank != 0:
        return None
    fake = FakeDriver(Params(cfg.fusion_threshold, cfg.cycle_time_ms))
    tuning.driver = fake  # type: ignore[assignment]
    return fake


def _ar(name: str, value: float, ps=None):
    return hvd.allreduce_async(np.full(4, value), op=hvd.Sum, name=name,
                               process_set=ps or hvd.global_process_set)


# -- the response cache ---------------------------------------------------------------------------
def test_cache_switches_off_and_on_at_a_shared_round_with_hits_waiting():
    def body(rank):
        p = plane()
        ps = current().member_sets()[0]
        fake = _install_fake(rank)
        hs = [_ar("x", 1.0), _ar("y", 1.0)]
        cycle()
        for h in hs:
            h.wait(0)
        assert len(ps.cache) == 2
        # Rank 0's "x" is a cache hit that waits for rank 1.
        h = _ar("x", rank + 1.0) if rank == 0 else None
        cycle()
        assert (rank == 0) == bool(ps.hits)
        if fake is not None:
            fake.want(cache_enabled=False)
        cycle()  # the retune round: the cache goes off at its end, on both ranks
        assert ps.cache.capacity == 0 and len(ps.cache) == 0 and ps.cache.num_bits == 0
        assert not ps.hits and len(ps.carry) == (1 if rank == 0 else 0)
        if rank == 1:
            h = _ar("x", 2.0)
        cycle(2)
        np.testing.assert_allclose(h.wait(0), np.full(4, 3.0))
        # Off: every op takes the slow path and nothing is cached.
        g = p.calls["gather"]
        for step in range(3):
            h = _ar("y", float(step))
            cycle()
            np.testing.assert_allclose(h.wait(0), np.full(4, 2.0 * step))
        assert p.calls["gather"] == g + 3 and len(ps.cache) == 0
        # On again: the next slow path fills the cache, later rounds hit.
        if fake is not None:
            fake.want(cache_enabled=True)
        h = _ar("y", 1.0)
        cycle()  # the retune round (the op goes through the slow path, uncached)
        h.wait(0)
        assert ps.cache.capacity == current().config.cache_capacity
        h = _ar("y", 1.0)
        cycle()
        h.wait(0)
        assert len(ps.cache) == 1
        g = p.calls["gather"]
        for _ in range(3):
            h = _ar("y", 1.0)
            cycle()
            np.testing.assert_allclose(h.wait(0), np.full(4, 2.0))
        assert p.calls["gather"] == g
        tuning = current().coordinator.tuning
        return [(r, q.cache_enabled) for r, q in tuning.retunes]

    out = run_loopback(2, body, start=False, control=CountingPlane, timeout=60)
    assert out[0] == out[1] and [c for _, c in out[0]] == [False, True]


def test_cache_switch_reaches_another_process_set_at_its_next_round():
    def body(rank):
        add = current().request_process_set_change("add", hvd.ProcessSet([0, 1]))
        cycle()
        extra = add.wait(0)
        sets = current().member_sets()
        ps1 = next(s for s in sets if s.id != 0)
        fake = _install_fake(rank)
        h = _ar("z", 1.0, extra)
        cycle(3)
        h.wait(0)
        assert len(ps1.cache) == 1
        h = _ar("z", 1.0, extra) if rank == 0 else None  # a hit waiting for rank 1
        cycle()
        if fake is not None:
            fake.want(cache_enabled=False)
        cycle()  # global retune round, then the other set's round: both switch
        assert ps1.cache.capacity == 0 and len(ps1.cache) == 0 and not ps1.hits
        if rank == 1:
            h = _ar("z", 1.0, extra)
        cycle(2)
        np.testing.assert_allclose(h.wait(0), np.full(4, 2.0))
        if fake is not None:
            fake.want(cache_enabled=True)
        cycle()
        assert ps1.cache.capacity > 0
        for _ in range(2):
            h = _ar("z", 2.0, extra)
            cycle()
            np.testing.assert_allclose(h.wait(0), np.full(4, 4.0))
        assert len(ps1.cache) == 1
        return True

    assert run_loopback(2, body, start=False, dynamic_process_sets=True,
                        timeout=60) == [True, True]


@pytest.mark.parametrize("extra_set", [False, True], ids=["express", "two-sets"])
def test_cache_toggled_while_ops_run_through_every_path(extra_set):
    """Background coordinators, synchronous ops (the express lane when there is one set),
    async ops and ranks at different speeds, while rank 0 switches the cache every few
    allreduces: every result is right and both ranks switch at the same rounds."""
    def body(rank):
        rng = random.Random(rank)
        extra = hvd.add_process_set([0, 1]) if extra_set else None
        fake = _install_fake(rank)
        if fake is not None:
            fake.toggle_every = 17
        for step in range(120):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
            v = float(step + rank)
            out = hvd.allreduce(np.full(3, v), op=hvd.Sum, name=f"s{step % 5}")
            np.testing.assert_allclose(out, np.full(3, 2.0 * step + 1))
            hs = [_ar(f"a{i}", v + i) for i in range(3)]
            if extra is not None:
                hs.append(_ar("e", v, extra))
            for i, h in enumerate(hs):
                want = 2.0 * step + 1 + (2 * i if i < 3 else 0)
                np.testing.assert_allclose(h.wait(), np.full(4, want))
        coord = current().coordinator
        hvd.barrier()
        # with one set, some synchronous ops took the express lane (cache on)
        assert extra_set or coord.express_rounds > coord.express_waits
        return [(r, q.cache_enabled) for r, q in coord.tuning.retunes]

    out = run_loopback(2, body, dynamic_process_sets=extra_set, timeout=100)
    assert out[0] == out[1] and len(out[0]) >= 10, out


def test_csv_log_is_closed_when_the_job_stops_before_tuning_ends(tmp_path):
    """Rank 0's CSV log is closed when the coordinator's loop ends, tuning unfinished."""
    from collective.autotune import CSV_HEADER

    log = tmp_path / "at.csv"

    def body(rank):
        for _ in range(3):
            hvd.allreduce(np.full(4, 1.0), name="x")
        driver = current().coordinator.tuning.driver
        assert (driver is not None) == (rank == 0)
        return driver.tuner._log if driver is not None else None

    out = run_loopback(2, body, timeout=30, autotune=True, autotune_log=str(log),
                       autotune_steps_per_sample=1000)
    assert out[0] is not None and out[0].closed
    assert log.read_text() == CSV_HEADER + "\n"


# -- the bucket size ----------------------------------------------------------------------------
_SEED_LOCK = threading.Lock()  # torch's global generator is shared by the rank threads


def _model():
    import torch
    with _SEED_LOCK:
        torch.manual_seed(0)
        return _layers()


def _layers():
    import torch
    # 1 MB of weights per layer, 6 MB in all: 1, 4, 25 and 64 MB buckets all differ
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)]
    return torch.nn.Sequential(*layers)


def _batch(step: int, r: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g)


def _tuned_optimizer():
    """This rank's model and a DistributedOptimizer over it whose bucket size autotune tunes
    (it got a bucket schedule)."""
    import torch

    import horovod.torch as thvd
    model = _model()
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters())
    assert opt._hvd_reducer.schedule is not None
    return model, opt


def _check_averaged(model, ref, step: int, ranks, rtol: float, atol: float) -> None:
    """`model`'s gradients are the average over 2 ranks of each rank in `ranks`' own gradient
    at the same weights (computed on `ref`, a copy; ranks not listed contribute zeros)."""
    import torch
    ref.load_state_dict(model.state_dict())
    want = [torch.zeros_like(p) for p in ref.parameters()]
    for r in ranks:
        ref.zero_grad()
        xr, yr = _batch(step, r)
        torch.nn.functional.mse_loss(ref(xr), yr).backward()
        for w, p in zip(want, ref.parameters()):
            w += p.grad / 2
    for w, p in zip(want, model.parameters()):
        torch.testing.assert_close(p.grad, w, rtol=rtol, atol=atol)


class SlowRounds(CountingPlane):
    """Rank 1's coordinator enters some negotiation rounds late, so its training thread can
    finish a synchronize() before its coordinator applies a retune round."""

    def __init__(self, inner):
        super().__init__(inner)
        self.rng = random.Random(inner.rank)

    def allreduce_words(self, words, op):
        if self.rank == 1 and self.rng.random() < 0.5:
            time.sleep(self.rng.random() * 0.003)
        return super().allreduce_words(words, op)


def test_bucket_size_switches_at_the_same_step_on_every_rank():
    """The real tuner (threshold and cycle time held) with a DistributedOptimizer: ranks run
    skewed (random sleeps before backward and after step; rank 0's training thread slow to
    count its finished synchronize(), rank 1's coordinator slow to enter rounds: the order in
    which a rank announcing c + 1 instead of c + 2 would break), buckets are re-planned through
    several sizes, every rank re-plans after the same synchronize(), and every averaged
    gradient equals the mean of the ranks' own gradients."""
    torch = pytest.importorskip("torch")
    import horovod.torch as thvd

    def body(rank):
        rng = random.Random(10 + rank)
        model, opt = _tuned_optimizer()
        ref = _model()
        reducer = opt._hvd_reducer
        schedule = reducer.schedule
        if rank == 0:
            step_done = schedule.step_done

            def slow_step_done():
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 0.04)
                return step_done()
            schedule.step_done = slow_step_done
        tuning = current().coordinator.tuning
        # (announced step, this rank's completed steps) when each bucket size arrives here
        arrivals = []
        retune = tuning.retune

        def recording_retune(ps):
            retune(ps)
            p = tuning.retunes[-1][1]
            if p.bucket_from_step:
                arrivals.append((p.bucket_from_step, schedule.steps))
        tuning.retune = recording_retune
        plans = []
        step = 0
        after = None  # steps run after tuning ended (the last bucket switch is 2 steps ahead)
        while after is None or after < 3:
            if after is not None:
                after += 1
            step += 1
            # A broadcast that rank 0 starts now and rank 1 only after its step: rank 0's
            # coordinator has work pending all step long, so it negotiates at once.
            side = thvd.broadcast_async(torch.zeros(1), 0, name="side") if rank == 0 else None
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)
            opt.synchronize()
            _check_averaged(model, ref, step, (0, 1), rtol=1e-5, atol=1e-6)
            with opt.skip_synchronize():
                opt.step()
            if rank == 1:
                side = thvd.broadcast_async(torch.zeros(1), 0, name="side")
            thvd.synchronize(side)
            plans.append((reducer.cap_mb, tuple(b.name for b in reducer.buckets)))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)
            done = bool(tuning.retunes) and not tuning.retunes[-1][1].active
            # (every 4th step: the other steps' samples close on a bucket's allreduce)
            if after is None and step % 4 == 0 and thvd.allreduce(
                    torch.tensor([1.0 if done else 0.0]), op=thvd.Min,
                    name="done").item() == 1.0:
                after = 0
            assert step < 400, tuning.retunes
        return plans, list(tuning.bucket_plan), schedule.steps, arrivals

    (p0, b0, s0, a0), (p1, b1, s1, a1) = run_loopback(
        2, body, timeout=60, control=SlowRounds, autotune=True, autotune_steps_per_sample=1,
        autotune_warmup_samples=1, fusion_threshold=64 * 1024 * 1024, cycle_time_ms=0.5)
    # No rank had passed the announced step when the announcement reached it.
    assert all(done < at for at, done in a0 + a1), (a0, a1)
    assert p0 == p1 and b0 == b1 and s0 == s1 == len(p0)
    sizes = [cap for cap, _ in p0]
    assert {1.0, 4.0, 25.0, 64.0} <= set(sizes), b0
    assert sizes[-1] == b0[-1][1]  # the chosen size is in force at the end
    # each announced size took effect right after the step it names, on both ranks
    for from_step, cap in b0:
        assert sizes[from_step - 1] == cap, (from_step, cap, sizes)
    assert len({names for _, names in p0}) >= 3


@pytest.mark.parametrize("dropped", [True, False], ids=["dropped", "kept-idle"])
def test_tuning_moves_on_when_the_tuned_optimizer_stops_during_a_bucket_switch(dropped):
    """The optimizer whose buckets are tuned is dropped, or kept but no longer stepped, while
    a bucket size announced for a later step is pending (rank 0's driver waits for its step
    count to pass it): training goes on with plain allreduces, and tuning still ends, at the
    same rounds on every rank (kept: once the driver's wait runs out); a new
    DistributedOptimizer afterwards keeps the configured bucket size. A kept optimizer that
    steps again applies the pending size after the announced step, on every rank alike."""
    torch = pytest.importorskip("torch")
    import gc

    import horovod.torch as thvd

    def body(rank):
        model, opt = _tuned_optimizer()
        tuning = current().coordinator.tuning
        step = 0
        while True:
            step += 1
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            driver = tuning.driver
            waiting = driver is not None and driver._settle_until > 0
            if thvd.allreduce(torch.tensor([1.0 if waiting else 0.0]), op=thvd.Max,
                              name="waiting").item() == 1.0:
                break
            assert step < 200, tuning.retunes
        if dropped:
            del opt
            gc.collect()
            assert not tuning.buckets_ready()
        else:
            assert tuning.buckets_ready()  # alive: only the driver's bound ends the wait
        # Training goes on without the optimizer: its gradients reduced one by one.
        after = 0
        while True:
            after += 1
            for i, p in enumerate(model.parameters()):
                thvd.allreduce(torch.ones_like(p) * rank, name=f"g{i}")
            done = bool(tuning.retunes) and not tuning.retunes[-1][1].active
            if thvd.allreduce(torch.tensor([1.0 if done else 0.0]), op=thvd.Min,
                              name="done").item() == 1.0:
                break
            assert after < 300, ("tuning never ended", tuning.retunes)
        # A later optimizer is not tuned (every rank alike): it keeps the configured size.
        # (Over other parameters when the first one is kept: its hooks are still on these.)
        model2 = model if dropped else _model()
        opt2 = thvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.01),
                                         named_parameters=model2.named_parameters())
        assert opt2._hvd_reducer.schedule is None and opt2._hvd_reducer.cap_mb == 25.0
        for s in range(3):
            x, y = _batch(1000 + s, rank)
            opt2.zero_grad()
            torch.nn.functional.mse_loss(model2(x), y).backward()
            opt2.step()
        del opt2
        caps = []
        if not dropped:  # the kept optimizer steps again, through the announced step
            reducer = opt._hvd_reducer
            for s in range(3):
                x, y = _batch(2000 + s, rank)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                caps.append((reducer.schedule.steps, reducer.cap_mb,
                             tuple(b.name for b in reducer.buckets)))
        return [(r, q) for r, q in tuning.retunes], list(tuning.bucket_plan), caps

    out = run_loopback(2, body, timeout=90, autotune=True, autotune_steps_per_sample=1,
                       autotune_warmup_samples=1, fusion_threshold=64 * 1024 * 1024,
                       cycle_time_ms=0.5)
    assert out[0] == out[1], out
    retunes, plan, caps = out[0]
    assert plan and not retunes[-1][1].active
    if not dropped:
        at, cap = plan[-1]
        assert [c for n, c, _ in caps if n >= at] == [cap] * sum(n >= at for n, _, _ in caps)
        assert caps[-1][1] == cap and caps[-1][0] >= at


def test_a_join_withdraws_a_bucket_size_no_rank_has_applied_and_holds_the_size():
    """A bucket size is announced for step c + 2; rank 1 runs out of data after step c + 1 and
    joins, while rank 0 runs on to step c + 4 (past c + 2) before it joins too. A joined rank
    stops counting steps, so had rank 0 re-planned after step c + 2, the ranks would plan
    different buckets after the join and hang: the first join round withdraws the
    announcement on every rank and holds the bucket size. Both ranks then train on with the
    same buckets and correctly averaged gradients, and no size is announced any more."""
    torch = pytest.importorskip("torch")
    import horovod.torch as thvd

    def body(rank):
        fake = _install_fake(rank)
        model, opt = _tuned_optimizer()
        ref = _model()
        reducer = opt._hvd_reducer
        schedule = reducer.schedule
        tuning = current().coordinator.tuning

        def step(n, ranks=(0, 1)):
            x, y = _batch(n, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.synchronize()
            _check_averaged(model, ref, n, ranks, rtol=1e-4, atol=1e-5)  # joined ranks: zeros
            with opt.skip_synchronize():
                opt.step()

        for n in range(1, 4):
            step(n)
        c = schedule.steps
        if rank == 0:
            fake.want(bucket_cap_mb=1.0, bucket_from_step=c + 2)
        thvd.allreduce(torch.zeros(1), name="announce")  # a round: the retune reaches both
        assert tuning.bucket_plan == [(c + 2, 1.0)]
        step(c + 1)
        if rank == 0:
            for n in range(c + 2, c + 5):
                step(n, ranks=(0,))
        last = thvd.join()
        assert tuning.join_seen and tuning.buckets_held and tuning.bucket_plan == []
        assert not tuning.buckets_ready() and (rank != 0 or fake.held)
        caps = []
        for n in range(100, 103):
            step(n)
            caps.append((reducer.cap_mb, tuple(b.name for b in reducer.buckets)))
        return caps, last

    (c0, l0), (c1, l1) = run_loopback(2, body, timeout=60, autotune=True,
                                      autotune_steps_per_sample=1000,
                                      fusion_threshold=64 * 1024 * 1024, cycle_time_ms=0.5)
    assert c0 == c1 and {cap for cap, _ in c0} == {25.0}
    assert l0 == l1 == 0  # rank 0 joined last
