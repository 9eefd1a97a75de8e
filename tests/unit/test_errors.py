"""The exception family (collective/errors.py): Horovod-compatible base classes and texts."""
from __future__ import annotations

import pytest

import collective as hvd
from collective import errors

pytestmark = pytest.mark.timeout(30)


def test_horovod_base_classes():
    assert issubclass(errors.NotInitializedError, ValueError)
    assert issubclass(errors.DuplicateNameError, ValueError)
    assert issubclass(errors.HorovodInternalError, RuntimeError)
    for cls in (errors.MismatchError, errors.ShutdownError, errors.CollectiveTimeoutError,
                errors.StallError):
        assert issubclass(cls, errors.HorovodInternalError)
    assert issubclass(errors.CollectiveTimeoutError, TimeoutError)
    assert issubclass(errors.EngineUnavailableError, ImportError)
    assert issubclass(errors.HostsUpdatedInterrupt, RuntimeError)
    assert not issubclass(errors.HostsUpdatedInterrupt, errors.HorovodInternalError)
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and obj is not errors.HostsUpdatedInterrupt:
            assert issubclass(obj, errors.CollectiveError), name
            assert obj.__doc__, f"{name} has no docstring"


def test_exact_texts():
    assert str(errors.NotInitializedError()) == "Horovod has not been initialized; use hvd.init()."
    assert str(errors.ShutdownError()) == (
        "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
        "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
        "execution. If the shutdown was caused by an exception, you should see the exception "
        "in the log before the first shutdown message.")


def test_shutdown_error_names_who_ended_the_job():
    from collective.coordinator import shutdown_error
    plain = str(errors.ShutdownError())
    assert str(shutdown_error(None)) == plain
    assert str(shutdown_error(None, {})) == plain
    assert type(shutdown_error(None, {1: "shutdown"})) is errors.ShutdownError
    err = shutdown_error(None, {3: "shutdown", 0: "stall", 2: "shutdown"})
    assert isinstance(err, errors.StallError) and isinstance(err, errors.ShutdownError)
    assert str(err) == (plain + " Rank(s) 0 shut the job down after a stall "
                        "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; the stall warnings in the log of "
                        "that rank name what waited). Rank(s) 2, 3 ended the job "
                        "(hvd.shutdown(), or the end of the program).")
    # A job that ended on an error keeps that error; another cause is chained.
    cause = errors.MismatchError("boom")
    assert shutdown_error(cause, {1: "shutdown"}) is cause
    other = OSError("gone")
    err = shutdown_error(other, {1: "shutdown"})
    assert str(err) == plain and err.__cause__ is other


def test_hosts_updated_interrupt_skip_sync():
    assert errors.HostsUpdatedInterrupt().skip_sync is False
    assert errors.HostsUpdatedInterrupt(True).skip_sync is True


def test_public_reexports():
    for name in ("HorovodInternalError", "ShutdownError", "MismatchError", "DuplicateNameError",
                 "NotInitializedError", "HostsUpdatedInterrupt"):
        assert getattr(hvd, name) is getattr(errors, name)


def test_not_initialized_from_public_api():
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd\.init\(\)\.$"):
        hvd.allreduce_async(hvd_array())


def hvd_array():
    import numpy as np
    return np.ones(1)
