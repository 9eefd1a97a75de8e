"""`init()` that fails part-way, in one process (the size-1 world of a plain `python
train.py`): it leaves ringvod uninitialised, with every connection, engine and thread it had
made released, and a later `init()` works."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import collective as hvd
from collective.engines.loopback import LoopbackControlPlane
from collective.errors import NOT_INITIALIZED_MESSAGE
from collective.runtime import Runtime
from tests._faults import coordinator_thread_refused

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def made(monkeypatch):
    """The runtimes `init()` makes, and the control planes closed since (by identity)."""
    runtimes, closed = [], []
    original_init = Runtime.__init__

    def recording_init(self, config, control, *args, **kwargs):
        runtimes.append(self)  # kept even when the constructor raises
        original_init(self, config, control, *args, **kwargs)

    monkeypatch.setattr(Runtime, "__init__", recording_init)
    monkeypatch.setattr(LoopbackControlPlane, "close", lambda self: closed.append(self),
                        raising=False)
    yield runtimes, closed
    hvd.shutdown()


def _assert_uninitialised():
    assert not hvd.is_initialized()
    with pytest.raises(ValueError) as info:
        hvd.size()
    assert str(info.value) == NOT_INITIALIZED_MESSAGE
    alive = [t.name for t in threading.enumerate() if t.name.startswith("hvd-")]
    assert alive == [], alive


def _works_again():
    hvd.init()
    try:
        np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="again"),
                                      np.ones(2))
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()


def test_a_coordinator_that_cannot_start_leaves_ringvod_uninitialised(made, monkeypatch):
    runtimes, closed = made

    with coordinator_thread_refused(monkeypatch):
        with pytest.raises(RuntimeError, match="can't start new thread"):
            hvd.init()
    _assert_uninitialised()
    rt = runtimes[-1]
    assert rt.control in closed and rt.shut_down
    with pytest.raises(hvd.ShutdownError):  # a stale reference to it refuses work
        rt._check_running()
    _works_again()


def test_a_warning_turned_error_at_init_leaves_ringvod_uninitialised(made, monkeypatch):
    runtimes, closed = made
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")  # no effect: init() warns
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="HOROVOD_HIERARCHICAL_ALLREDUCE is set"):
            hvd.init()
    _assert_uninitialised()
    assert runtimes[-1].control in closed
    monkeypatch.delenv("HOROVOD_HIERARCHICAL_ALLREDUCE")
    _works_again()


def test_a_construction_step_that_raises_closes_what_it_opened(made):
    """Two equal static sets: the first is registered (a plane, an engine) before the second
    raises; the world's plane and the first set's are closed."""
    runtimes, closed = made
    with pytest.raises(ValueError, match="^Attempted to add a duplicate process set"):
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])])
    _assert_uninitialised()
    rt = runtimes[-1]
    planes = [ps.control for ps in rt._members]
    assert len(planes) == 2 and planes[0] is rt.control
    assert all(any(p is c for c in closed) for p in planes)
    _works_again()
