"""The elastic retry loop (`collective.elastic.run_fn`) on loopback ranks (threads of this
process): after a reset every rank must make the same sync decision, whichever way it left the
training function. The reset is a no-op here (the loopback world stays up), which stands for a
new world of the same ranks."""
from __future__ import annotations

import numpy as np
import pytest

import collective as hvd
from collective.elastic import ObjectState, run_fn
from collective.errors import HorovodInternalError, HostsUpdatedInterrupt
from tests._spmd import run_loopback

pytestmark = pytest.mark.timeout(60)


class CountingState(ObjectState):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1
        super().sync()


def _run(outcomes: list[BaseException]) -> list[tuple[int, int, float]]:
    """Rank r's first call of the training function advances `step` and raises outcomes[r];
    the second call runs one allreduce. Returns (syncs, step, allreduce result) per rank."""

    def body(rank: int) -> tuple[int, int, float]:
        state = CountingState(step=0)
        calls = []

        def train(state):
            calls.append(state.step)
            if len(calls) == 1:
                state.step += 1  # not committed: a restore drops it, an interrupt keeps it
                raise outcomes[rank]
            return float(hvd.allreduce(np.ones(1), name="after.reset", op=hvd.Sum)[0])

        resets = []

        def reset() -> None:
            resets.append(1)
            if len(resets) > 1:  # the broken loop of a hang: stop once the test timed out
                raise RuntimeError("a second reset")

        total = run_fn(train, reset)(state)
        return state.syncs, state.step, total

    return run_loopback(len(outcomes), body, timeout=20.0)


@pytest.mark.parametrize("failed", [[1], [0], [0, 2], [2]])
def test_mixed_interrupt_and_failure_sync_everywhere(failed: list[int]) -> None:
    """A peer dies during `check_host_updates()`' broadcast: some ranks got the interrupt for
    removed hosts (skip_sync=True), the others the `HorovodInternalError`. The failed ranks
    restore and must sync, so every rank syncs (a rank that skipped would run the training
    collectives against the others' sync broadcast: a hang) and all end with rank 0's state."""
    outcomes = [HorovodInternalError("peer died") if r in failed else HostsUpdatedInterrupt(True)
                for r in range(3)]
    res = _run(outcomes)
    assert [syncs for syncs, _, _ in res] == [2, 2, 2], res
    assert len({step for _, step, _ in res}) == 1, res
    assert [total for _, _, total in res] == [3.0] * 3, res


def test_interrupt_for_removed_hosts_everywhere_skips_sync() -> None:
    """Every rank got skip_sync=True: no sync after the reset, the uncommitted step is kept."""
    res = _run([HostsUpdatedInterrupt(True)] * 2)
    assert res == [(1, 1, 2.0)] * 2


def test_interrupt_for_added_hosts_syncs() -> None:
    """The sync after an interrupt keeps the uncommitted step: nothing is rolled back (the
    model and optimizer are synced as they are, so the attributes must be too)."""
    res = _run([HostsUpdatedInterrupt(False)] * 2)
    assert res == [(2, 1, 2.0)] * 2, res


def test_failure_syncs_the_last_commit() -> None:
    res = _run([HorovodInternalError("peer died")] * 2)
    assert res == [(2, 0, 2.0)] * 2, res


def test_sync_sends_rank_0s_snapshot_and_values() -> None:
    """After a sync, every rank has rank 0's current attributes and rank 0's snapshot (a later
    restore goes back to the same commit everywhere)."""

    def body(rank: int) -> tuple[int, int, int]:
        state = ObjectState(step=rank)  # snapshot: step=rank
        state.step = 10 + rank          # uncommitted
        state.sync()
        synced = state.step
        state.restore()
        return synced, state.step, rank

    assert [r[:2] for r in run_loopback(3, body, timeout=20.0)] == [(10, 0)] * 3


class _FakeRuntime:
    rank, mode, config = 1, "tcp", None

    def start(self) -> "_FakeRuntime":
        return self

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("inits_before, asks, fails, attempts", [
    (0, True, 2, 3),     # the first elastic init(): it asks the driver again, and joins
    (0, True, 25, 20),   # ... up to 20 times
    (0, False, 1, 1),    # not elastic (no request to the driver): no retry
    (1, True, 1, 1),     # a later init() (a reset's, which retries itself): no retry
])
def test_first_elastic_init_asks_again_when_the_world_fails_to_form(
        monkeypatch, inits_before, asks, fails, attempts) -> None:
    """A peer dies while the world of a worker's first init() forms: that init() asks the
    elastic driver for a place again (as a reset does) instead of failing the worker."""
    import collective.basics as basics
    import collective.elastic as elastic

    monkeypatch.setattr(elastic, "_inits", inits_before)
    calls = []

    def create(**kwargs):
        calls.append(1)
        if asks:
            elastic._inits += 1  # what the rendezvous with the driver counts
        if len(calls) <= fails:
            raise HorovodInternalError("test: a peer died while the world formed")
        return _FakeRuntime()

    monkeypatch.setattr(basics.Runtime, "create", staticmethod(create))
    try:
        if attempts > fails:
            basics.init()
            assert basics.is_initialized()
        else:
            with pytest.raises(HorovodInternalError, match="a peer died"):
                basics.init()
            assert not basics.is_initialized()
    finally:
        basics.shutdown()
    assert len(calls) == attempts


@pytest.mark.parametrize("inits, attempts", [(0, 1), (1, 20)])
def test_reset_retries_the_rendezvous_only_in_an_elastic_job(monkeypatch, inits,
                                                             attempts) -> None:
    """`hvd.elastic.run` in a job that is not elastic (hvdrun without --min-np, mpirun) whose
    peer exited: the reset's init() re-forms the same ranks and fails (after
    HOROVOD_GLOO_TIMEOUT_SECONDS). It raises at once; it retried 20 times (10 minutes at the
    default timeout). An elastic job (a driver to ask) retries as before."""
    import collective.basics as basics
    import collective.elastic as elastic

    monkeypatch.setattr(elastic, "_inits", inits)
    calls = []

    def init() -> None:
        calls.append(1)
        raise HorovodInternalError("test: timed out waiting for key 'addr.1'")

    monkeypatch.setattr(basics, "init", init)
    monkeypatch.setattr(basics, "shutdown", lambda: None)
    with pytest.raises(HorovodInternalError, match="addr.1"):
        elastic.reset()
    assert len(calls) == attempts


def test_mismatch_is_raised_not_retried() -> None:
    """Ranks that submit different shapes under one name (a bug of the script) get the
    MismatchError out of the training function on every rank. It was retried: restore, reset,
    the same mismatch at the same step, forever (about 70 resets a second under hvdrun)."""
    from collective.errors import MismatchError

    def body(rank: int) -> tuple[str, int]:
        state = ObjectState(step=0)
        resets = []

        def train(state):
            hvd.allreduce(np.ones(4 + rank), name="grad")  # a shape per rank

        def reset() -> None:
            resets.append(1)
            if len(resets) > 3:  # the old endless loop: stop it
                raise RuntimeError("reset again")

        try:
            run_fn(train, reset)(state)
        except MismatchError as exc:
            return "mismatch", len(resets)
        return "returned", len(resets)

    assert run_loopback(2, body, timeout=20.0) == [("mismatch", 0)] * 2
