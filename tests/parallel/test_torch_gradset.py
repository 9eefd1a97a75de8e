"""Per-gradient mode's gradient set (`HOROVOD_BUCKET_CAP_MB=0`, collective/gradset.py) under
real ranks: uneven steps with `join`, a different model on one rank, a re-`init()`, a reset
in the middle of a step, a stalled rank, ordinary ops in between, and an optimizer of another
process set whose member joins (3+ ranks). Launched by
tests/parallel/test_torch_driver.py with `HOROVOD_BUCKET_CAP_MB=0`; the stall shutdown test
alone, with `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (it ends the job).
"""
from __future__ import annotations

import copy
import logging
import os
import re
import time

import pytest
import torch

import horovod.torch as hvd_module
from tests.parallel._torch_util import PS_EVEN, init_world

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def hvd():
    init_world()
    return hvd_module


def _model(seed: int = 0, width: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 4))


def _opt(hvd, model, **kw):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(), **kw)


def _data(n: int, steps: int, seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n * 4, 8, generator=g), torch.randn(n * 4, 4, generator=g))
            for _ in range(steps)]


def _step(hvd, model, opt, x, y) -> None:
    r = hvd.rank()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
    opt.step()


def _ref_step(ref, ref_opt, x, y, ranks: list[int], n: int) -> None:
    """The reference step of an average over `n` ranks of which only `ranks` have data (the
    others joined and contribute zeros)."""
    ref_opt.zero_grad()
    (sum(torch.nn.functional.mse_loss(ref(x[k * 4:(k + 1) * 4]), y[k * 4:(k + 1) * 4])
         for k in ranks) / n).backward()
    ref_opt.step()


def _same_on_every_rank(hvd, model, name: str) -> None:
    for p in model.parameters():
        gathered = hvd.allgather(p.detach().reshape(1, -1), name=name)
        assert torch.equal(gathered[0], gathered[-1])


def test_the_set_is_used(hvd) -> None:
    model = _model()
    opt = _opt(hvd, model)
    for x, y in _data(hvd.size(), 2):
        _step(hvd, model, opt, x, y)
    gs = opt._hvd_reducer.gset
    assert gs is not None and gs.n == 4 and gs in gs.runtime.process_set_state(
        hvd.global_process_set, "test").sets
    assert gs.names[0] == "allreduce.0.weight"
    _same_on_every_rank(hvd, model, "used.check")


def test_uneven_steps_with_join(hvd) -> None:
    # Rank r takes r + 2 steps, then joins: from each join on, the joined ranks contribute
    # zeros, and the gradient is still averaged over every rank.
    r, n = hvd.rank(), hvd.size()
    model = _model(1)
    opt = _opt(hvd, model)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = _data(n, n + 1)
    for step, (x, y) in enumerate(data[:r + 2]):
        _step(hvd, model, opt, x, y)
        _ref_step(ref, ref_opt, x, y, [k for k in range(n) if step < k + 2], n)
    assert hvd.join() == n - 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
    for x, y in _data(n, 2, seed=3):  # steps together after the join
        _step(hvd, model, opt, x, y)
    _same_on_every_rank(hvd, model, "join.check")


def test_different_model_on_one_rank_fails_everywhere(hvd) -> None:
    # The last rank's second layer is wider: every rank gets a ValueError naming the first
    # parameter that differs and the ranks, at the first backward, instead of a hang.
    n = hvd.size()
    model = _model(2, width=7 if hvd.rank() == n - 1 else 6)
    opt = _opt(hvd, model)
    x, y = _data(n, 1)[0]
    with pytest.raises(ValueError, match=r"gradients differ across ranks: parameter 0 "
                                         r"\('allreduce.0.weight' on rank \d\) .* on rank\(s\) "
                                         rf"\[{n - 1}\] than on rank 0"):
        _step(hvd, model, opt, x, y)
    opt._hvd_reducer.reset()
    ok = _model(2)
    ok_opt = _opt(hvd, ok)
    _step(hvd, ok, ok_opt, x, y)  # the job goes on
    _same_on_every_rank(hvd, ok, "mismatch.check")


def test_optimizer_survives_reinit(hvd) -> None:
    # hvd.shutdown() then hvd.init(): the optimizer registers its set with the new runtime.
    model = _model(3)
    opt = _opt(hvd, model)
    data = _data(hvd.size(), 4)
    for x, y in data[:2]:
        _step(hvd, model, opt, x, y)
    first = opt._hvd_reducer.gset
    hvd.shutdown()
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in data[2:]:
        _step(hvd, model, opt, x, y)
    assert opt._hvd_reducer.gset is not first
    _same_on_every_rank(hvd, model, "reinit.check")


def test_reset_in_the_middle_of_a_step(hvd) -> None:
    # Every rank runs backward, then changes backward_passes_per_step before stepping (a
    # reset mid-step): the half-done step is dropped and the next steps agree.
    model = _model(4)
    opt = _opt(hvd, model)
    data = _data(hvd.size(), 3)
    r = hvd.rank()
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
    old = opt._hvd_reducer.gset
    state = old.runtime.member_sets()[0]
    assert old in state.sets
    opt.set_backward_passes_per_step(1)
    for x, y in data[1:]:
        _step(hvd, model, opt, x, y)
    _same_on_every_rank(hvd, model, "reset.check")
    # Retired on every rank: the old set left the rounds (its words are no longer sent).
    assert old.retired and old not in state.sets
    assert opt._hvd_reducer.gset in state.sets


def test_unused_parameter_and_ordinary_ops_between(hvd) -> None:
    # A parameter without a gradient contributes zeros; ordinary ops run between steps.
    model = _model(5)
    extra = torch.nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(list(model.parameters()) + [extra], lr=0.05),
        named_parameters=list(model.named_parameters()) + [("extra", extra)])
    for i, (x, y) in enumerate(_data(hvd.size(), 3)):
        _step(hvd, model, opt, x, y)
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"between.{i}")
        assert torch.equal(total, torch.full((2,), float(hvd.size())))
    assert torch.equal(extra.grad, torch.zeros(3))
    _same_on_every_rank(hvd, model, "unused.check")


def test_stalled_rank_is_named(hvd, caplog) -> None:
    # The last rank steps late: the others warn about the gradients waiting for it.
    model = _model(6)
    opt = _opt(hvd, model)
    (x, y), (x2, y2) = _data(hvd.size(), 2)
    _step(hvd, model, opt, x2, y2)  # registers the set
    if hvd.rank() == hvd.size() - 1:
        time.sleep(2.5)
    logger = logging.getLogger("horovod")  # does not propagate: attach caplog to it
    logger.addHandler(caplog.handler)
    try:
        _step(hvd, model, opt, x, y)
    finally:
        logger.removeHandler(caplog.handler)
    if hvd.rank() != hvd.size() - 1:
        assert "did not submit gradients that this rank submitted" in caplog.text
        assert "allreduce.0.weight" in caplog.text
    _same_on_every_rank(hvd, model, "stall.check")


def test_stall_shutdown_ends_the_step(hvd) -> None:
    # The last rank stops stepping: with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS the others' step
    # fails after that time instead of waiting for ever, and the stalled rank's next op fails.
    limit = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0"))
    if limit <= 0:
        pytest.skip("run alone, with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (it ends the job)")
    model = _model(8)
    opt = _opt(hvd, model)
    (x, y), (x2, y2) = _data(hvd.size(), 2)
    _step(hvd, model, opt, x2, y2)  # registers the set
    if hvd.rank() == hvd.size() - 1:
        # Past the others' stall shutdown (`limit` after their step starts), and soon enough
        # that this rank reaches MPI_Finalize well inside the others' exit guard
        # (collective.engines.mpi.STALL_ABORT_GRACE after they exit) on a loaded machine.
        time.sleep(limit + 1)
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(torch.ones(1), name="after.stall")
        return
    start = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError):
        _step(hvd, model, opt, x, y)
    assert time.monotonic() - start < limit + 2.5


def test_a_rank_joins_before_the_set_registers(hvd) -> None:
    # The last rank has no data this epoch and joins at once: the others' first step cannot
    # register the set (a joined rank takes no part in the registration) and goes through
    # ordinary ops, with zeros from the joined rank; after the join the set registers.
    n, r = hvd.size(), hvd.rank()
    model = _model(7)
    opt = _opt(hvd, model)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = _data(n, 1)[0]
    if r != n - 1:
        _step(hvd, model, opt, x, y)
        assert opt._hvd_reducer.gset is None
    _ref_step(ref, ref_opt, x, y, list(range(n - 1)), n)
    assert hvd.join() != n - 1  # the joined rank was the first to join
    if r != n - 1:
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in _data(n, 2, seed=4):
        _step(hvd, model, opt, x, y)
    assert opt._hvd_reducer.gset is not None
    _same_on_every_rank(hvd, model, "joinfirst.check")


def test_a_rank_joins_in_the_middle_of_a_step(hvd) -> None:
    # The last rank runs backward (its gradients reach the set) and joins before step(): the
    # others, stepping later, average its gradients, not zeros in their place, and its own
    # step() after the join completes with the same average (before, the joined rank sent
    # zeros and its step waited for ever).
    n, r = hvd.size(), hvd.rank()
    model = _model(11)
    opt = _opt(hvd, model)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x0, y0 = _data(n, 1, seed=5)[0]
    _step(hvd, model, opt, x0, y0)  # registers the set
    _ref_step(ref, ref_opt, x0, y0, list(range(n)), n)
    x, y = _data(n, 1, seed=6)[0]
    if r == n - 1:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r * 4:(r + 1) * 4]),
                                     y[r * 4:(r + 1) * 4]).backward()
        hvd.join()
        opt.step()
    else:
        time.sleep(0.5)  # the last rank has joined by now
        _step(hvd, model, opt, x, y)
        hvd.join()
    _ref_step(ref, ref_opt, x, y, list(range(n)), n)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    _same_on_every_rank(hvd, model, "midjoin.check")


def test_every_rank_joined_reduces_nothing(hvd) -> None:
    # Staggered joins: once every rank has joined, no gradient-set chunk runs (before, the
    # round in which the last rank joined reduced the whole model as zeros).
    import collective.coordinator.execute as execute
    model = _model(8)
    opt = _opt(hvd, model)
    x, y = _data(hvd.size(), 1)[0]
    _step(hvd, model, opt, x, y)
    ran = []
    original = execute._perform_chunk

    def spy(ps, chunk, *args):
        ran.append(chunk.joined)
        return original(ps, chunk, *args)
    execute._perform_chunk = spy
    try:
        time.sleep(0.2 * hvd.rank())
        hvd.join()
    finally:
        execute._perform_chunk = original
    assert ran == []


@pytest.mark.timeout(40)  # it used to wait for ever (a stall warning on the stepping rank)
@pytest.mark.parametrize("order", ["join-first", "step-first"])
@pytest.mark.parametrize("joiner", ["set-root", "other"])
def test_a_member_of_another_set_joins(hvd, caplog, joiner, order) -> None:
    # join() covers the global process set only: an optimizer of another set cannot step while
    # a member waits in join(). The members that step fail, naming the gradients, the set and
    # the joined rank; the joined rank logs the same and its join completes; afterwards the
    # set's optimizer registers a new set and steps on every member.
    if not 2 <= len(PS_EVEN.ranks) < hvd.size():
        pytest.skip("needs a process set of 2+ ranks other than the global one (3+ ranks)")
    if PS_EVEN.process_set_id is None:  # an earlier test's shutdown() and init() dropped it
        hvd.shutdown()
        init_world()
    ps, me = PS_EVEN, hvd.rank()
    psid = ps.process_set_id
    joined = ps.ranks[0] if joiner == "set-root" else ps.ranks[-1]
    model = _model(10)
    opt = _opt(hvd, model, process_set=ps) if ps.included() else None
    data = _data(hvd.size(), 3)
    if opt is not None:
        _step(hvd, model, opt, *data[0])  # registers the set on every member
        first = opt._hvd_reducer.gset
        assert first is not None
    hvd.barrier()
    logger = logging.getLogger("horovod")  # does not propagate: attach caplog to it
    logger.addHandler(caplog.handler)
    try:
        if me == joined or opt is None:
            if order == "step-first":
                time.sleep(0.5)
            last = hvd.join()
        else:
            if order == "join-first":
                time.sleep(0.5)
            # The gradients named are those submitted when the failure was agreed.
            text = (f"allreduce of gradient(s) 'allreduce.* on process set {psid} "
                    f"(ranks {ps.ranks}) cannot complete: rank(s) {joined} called hvd.join() "
                    f".* Finish the optimizer's steps on process set {psid} on every member "
                    "before calling hvd.join()")
            with pytest.raises(hvd.HorovodInternalError,
                               match=re.escape(text).replace(r"\.\*", ".*")):
                _step(hvd, model, opt, *data[1])
            # Raised by a gradient hook (the failure came during backward), it leaves the step
            # open, as any error from backward does: close it.
            opt._hvd_reducer.reset()
            last = hvd.join()
    finally:
        logger.removeHandler(caplog.handler)
    if me == joined:
        assert f"Rank {joined} waits in hvd.join() while other ranks of process set" in caplog.text
    assert last != joined  # the others join once their step failed
    if opt is not None:
        _step(hvd, model, opt, *data[2])  # a new set, on every member
        assert opt._hvd_reducer.gset not in (None, first)
        assert first not in first.runtime.process_set_state(ps, "test").sets
        for p in model.parameters():
            gathered = hvd.allgather(p.detach().reshape(1, -1), name="joinps.check",
                                     process_set=ps)
            assert torch.equal(gathered[0], gathered[-1])
    hvd.barrier()


def test_a_failure_in_backward_then_reinit(hvd) -> None:
    # As in elastic training: the job ends while this rank is still in backward (its hooks
    # then raise), the optimizer is reset, and after init() the ranks register a new set.
    model = _model(9)
    opt = _opt(hvd, model)
    data = _data(hvd.size(), 3)
    _step(hvd, model, opt, *data[0])
    r = hvd.rank()
    hvd.shutdown()
    if r == 0:
        x, y = data[1]
        with pytest.raises(Exception, match="has not been initialized|shut down"):
            torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
    opt.load_state_dict(opt.state_dict())  # elastic's restore resets the optimizer
    assert len(opt._hvd_reducer.members) == 4
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _step(hvd, model, opt, *data[2])
    _same_on_every_rank(hvd, model, "failure.check")
