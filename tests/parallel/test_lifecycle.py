"""Lifecycle under real ranks: calls before init, idempotent init, init -> shutdown -> init,
an init() that fails after the ranks connected (uninitialised, nothing left running, init()
works again; also in tcp mode), and one rank shutting down (or exiting) failing the others'
pending ops with the shutdown error within a few seconds."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import collective as hvd
from collective.errors import NOT_INITIALIZED_MESSAGE, SHUT_DOWN_MESSAGE
from tests._faults import coordinator_thread_refused
from tests._spmd import run_spmd, spmd_driver, spmd_rank
from tests.parallel._util import env_size

pytestmark = [pytest.mark.spmd, pytest.mark.timeout(90)]

test_spmd = spmd_driver(__file__, nps=(1, 2, 4), timeout=120)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_early_exit.py")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["shutdown-exit", "plain-exit"])
def test_rank_that_exits_fails_the_others(how):
    """The last rank leaves (hvd.shutdown() + exit, or just exit through atexit) while the
    others wait in an allreduce it never joins: they get the shutdown error within seconds."""
    run_spmd(SCRIPT, np=3 if how == "plain-exit" else 2, timeout=60, args=[how])


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(90)
def test_rank_that_exits_fails_the_others_in_tcp_mode():
    """The same under `hvdrun --gloo`: the job's last round (which also tells every rank who
    ended the job) runs over the tcp control plane."""
    run_spmd(SCRIPT, np=2, timeout=60, mode="tcp", args=["shutdown-exit"])


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(150)
def test_failed_init_in_tcp_mode():
    """The failed-init tests below under `hvdrun --gloo`, whose connections and threads
    (accept, senders) a failed init() must not leave behind."""
    run_spmd(__file__, 2, timeout=120, mode="tcp", args=["-k", "failed_init"])


def _assert_uninitialised_and_nothing_running():
    assert not hvd.is_initialized()
    with pytest.raises(ValueError) as info:
        hvd.size()
    assert str(info.value) == NOT_INITIALIZED_MESSAGE
    alive = [t.name for t in threading.enumerate() if t.name.startswith("hvd-")]
    assert alive == [], f"threads left by the failed init(): {alive}"


def _init_works_again(name: str = "after_failed_init"):
    hvd.init()
    try:
        got = hvd.allreduce(np.ones(2), op=hvd.Sum, name=name)
        np.testing.assert_allclose(got, np.full(2, hvd.size()))
    finally:
        hvd.shutdown()


def test_failed_init_after_the_ranks_connected_leaves_nothing(monkeypatch):
    """Every rank's coordinator refuses to start (the last step of init())."""
    with coordinator_thread_refused(monkeypatch):
        with pytest.raises(RuntimeError, match="can't start new thread"):
            hvd.init()
    _assert_uninitialised_and_nothing_running()
    _init_works_again()


def test_failed_init_of_process_sets_that_differ_leaves_nothing():
    n, me = env_size(), spmd_rank()
    if n == 1:
        pytest.skip("one rank cannot pass sets that differ from its peers'")
    sets = [hvd.ProcessSet([n - 1] if me == n - 1 else [0])]
    with pytest.raises(ValueError, match="^ranks passed different process sets to init"):
        hvd.init(process_sets=sets)
    assert sets[0].process_set_id is None
    _assert_uninitialised_and_nothing_running()
    _init_works_again()


def test_calls_before_init_raise_value_error():
    assert not hvd.is_initialized()
    for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank,
               hvd.cross_size, lambda: hvd.allreduce(np.ones(1)),
               lambda: hvd.allreduce_async(np.ones(1), name="x"), hvd.barrier, hvd.join,
               lambda: hvd.broadcast(np.ones(1), 0), lambda: hvd.allgather(np.ones(1)),
               lambda: hvd.start_timeline("/tmp/x.json")):
        with pytest.raises(ValueError) as info:
            fn()
        assert str(info.value) == NOT_INITIALIZED_MESSAGE
    hvd.shutdown()  # a no-op when not initialised


def test_init_is_idempotent_and_restartable():
    for cycle in range(3):
        hvd.init()
        hvd.init()  # idempotent
        assert hvd.is_initialized() and hvd.mode() == "mpi"
        got = hvd.allreduce(np.full(3, float(hvd.rank())), op=hvd.Sum, name="restart")
        np.testing.assert_allclose(got, np.full(3, float(sum(range(hvd.size())))))
        got = hvd.allgather(np.array([cycle], dtype=np.int32), name="restart.ag")
        np.testing.assert_array_equal(got, np.full(hvd.size(), cycle))
        hvd.shutdown()
        assert not hvd.is_initialized()
        with pytest.raises(ValueError, match="has not been initialized"):
            hvd.size()
    hvd.shutdown()  # twice is fine


def test_one_rank_shutdown_fails_pending_ops_everywhere():
    hvd.init()
    try:
        n, me = hvd.size(), hvd.rank()
        hvd.barrier()
        if me == n - 1:
            time.sleep(0.2)  # let the others' requests reach the coordinator first
            hvd.shutdown()
        else:
            h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="never_completes")
            t0 = time.monotonic()
            with pytest.raises(hvd.HorovodInternalError) as info:
                h.wait(30)
            dt = time.monotonic() - t0
            assert dt < 5.0, f"pending op failed only after {dt:.1f} s"
            assert isinstance(info.value, hvd.ShutdownError)
            # Horovod's text, then the rank that ended the job.
            assert str(info.value) == (f"{SHUT_DOWN_MESSAGE} Rank(s) {n - 1} ended the job "
                                       "(hvd.shutdown(), or the end of the program).")
            # New ops on a shut-down runtime fail at once with the same error.
            with pytest.raises(hvd.ShutdownError, match=rf"Rank\(s\) {n - 1} ended the job"):
                hvd.allreduce(np.ones(1), name="after_shutdown")
    finally:
        hvd.shutdown()
    _init_works_again("after_restart")  # everyone restarts together
