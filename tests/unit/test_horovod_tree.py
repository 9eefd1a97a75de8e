"""Horovod's module tree beyond the API: `horovod.common.exceptions`, `horovod.common.elastic`,
`horovod.common.process_sets` and `horovod.runner.util.threads`, which scripts and test helpers
import."""
from __future__ import annotations

import threading
import time

import pytest


def test_common_exceptions_are_ringvods_classes():
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    import collective
    from collective import errors

    assert HorovodInternalError is errors.HorovodInternalError is collective.HorovodInternalError
    assert HostsUpdatedInterrupt is errors.HostsUpdatedInterrupt
    assert issubclass(HorovodInternalError, RuntimeError)
    assert issubclass(HostsUpdatedInterrupt, RuntimeError)
    # What the runtime raises for a failed collective is caught under Horovod's name.
    with pytest.raises(HorovodInternalError):
        raise errors.ShutdownError()
    assert HostsUpdatedInterrupt(True).skip_sync is True


def test_in_thread_runs_target_and_checks_args():
    from horovod.runner.util.threads import in_thread

    seen = []
    thread = in_thread(seen.append, args=(7,), name="hvd-test")
    thread.join(5)
    assert seen == [7] and thread.daemon and thread.name == "hvd-test"
    assert in_thread(lambda: None, daemon=False).daemon is False
    with pytest.raises(ValueError, match="args must be a tuple"):
        in_thread(seen.append, args=[1])


def test_in_thread_silent_swallows(monkeypatch):
    from horovod.runner.util.threads import in_thread

    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)

    def boom():
        raise KeyError("x")

    in_thread(boom, silent=True).join(5)
    assert hooked == []
    in_thread(boom).join(5)
    assert len(hooked) == 1 and hooked[0].exc_type is KeyError


def test_on_event_calls_after_event_and_honours_stop():
    from horovod.runner.util.threads import on_event

    event, calls = threading.Event(), []
    thread = on_event(event, calls.append, args=("fired",))
    time.sleep(0.05)
    assert calls == [] and thread.is_alive()
    event.set()
    thread.join(5)
    assert calls == ["fired"]

    never, stop = threading.Event(), threading.Event()
    thread = on_event(never, calls.append, args=("late",), stop=stop, check_stop_interval_s=0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and calls == ["fired"]

    with pytest.raises(ValueError, match="Event must not be None"):
        on_event(None, print)
    with pytest.raises(ValueError, match="Stop must be a threading.Event"):
        on_event(event, print, stop=object())
    with pytest.raises(ValueError, match="Check stop interval must be positive"):
        on_event(event, print, check_stop_interval_s=0)


def test_execute_function_multithreaded():
    from horovod.runner.util.threads import execute_function_multithreaded

    live, peak, lock = [0], [0], threading.Lock()

    def add(a, b):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.01)
        with lock:
            live[0] -= 1
        return a + b

    args = [[i, 10 * i] for i in range(8)]
    assert execute_function_multithreaded(add, args, max_concurrent_executions=3) == {
        i: 11 * i for i in range(8)}
    assert peak[0] <= 3
    assert args == [[i, 10 * i] for i in range(8)]
    assert execute_function_multithreaded(add, [(1, 2)], block_until_all_done=False) is None


def test_execute_function_multithreaded_reports_failed_calls(monkeypatch):
    from horovod.runner.util.threads import execute_function_multithreaded

    monkeypatch.setattr(threading, "excepthook", lambda _args: None)

    def fails_on_two(x):
        if x == 2:
            raise ValueError("two")
        return x

    with pytest.raises(RuntimeError, match="Some threads for func fails_on_two did not complete"):
        execute_function_multithreaded(fails_on_two, [(1,), (2,), (3,)])


def test_device_error_types_are_what_horovod_users_catch():
    # A grouped op mixing CPU and CUDA tensors: Horovod raises a RuntimeError (ringvod's was a
    # ValueError; it is both). A dtype NCCL cannot reduce fails at synchronize, where Horovod
    # raises HorovodInternalError.
    from collective import HorovodInternalError
    from collective.engines.device import DeviceOpError

    assert issubclass(DeviceOpError, RuntimeError) and issubclass(DeviceOpError, ValueError)
    assert not issubclass(DeviceOpError, HorovodInternalError)  # a local usage error


def test_common_elastic_is_collective_elastic():
    """`from horovod.common.elastic import ObjectState, State, run_fn` (custom states and
    wrappers) gives ringvod's classes, those of `hvd.elastic`."""
    from horovod.common.elastic import ObjectState, State, run_fn

    from collective import elastic

    assert (State, ObjectState, run_fn) == (elastic.State, elastic.ObjectState, elastic.run_fn)

    class Counter(ObjectState):  # a custom state, as with Horovod's
        pass

    state = Counter(bcast_object=lambda obj: obj, get_rank=lambda: 0, n=1)
    state.n = 5
    state.save()
    state.n = 9
    state.restore()
    assert state.n == 5


def test_common_process_sets_are_ringvods():
    """`from horovod.common.process_sets import ProcessSet, global_process_set, ...` gives the
    objects of `hvd` (and of `collective`)."""
    from horovod.common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                             remove_process_set)

    import collective

    assert ProcessSet is collective.ProcessSet
    assert global_process_set is collective.global_process_set
    assert add_process_set is collective.add_process_set
    assert remove_process_set is collective.remove_process_set
    assert ProcessSet([2, 0]).ranks == [0, 2]


def test_horovod_ray_runner_module_and_ray_trains_own_trainer():
    # Horovod's module path for RayExecutor works; Ray Train V1's own ray.train.horovod imports
    # Horovod's gloo Coordinator from it and fails with an error naming ringvod's trainer (it
    # was "No module named 'launcher.ray.runner'").
    import os
    import subprocess
    import sys

    from tests._spmd import skip_or_fail
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        skip_or_fail(f"ray not installed ({exc})", "ray")
    code = ("from horovod.ray.runner import RayExecutor\n"
            "from horovod.ray import RayExecutor as R\n"
            "assert RayExecutor is R\n"
            "try:\n"
            "    import ray.train.horovod\n"
            "except ImportError as e:\n"
            "    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, RAY_TRAIN_V2_ENABLED="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERR" in proc.stdout and "from horovod.ray import HorovodTrainer" in proc.stdout, (
        proc.stdout, proc.stderr[-2000:])
