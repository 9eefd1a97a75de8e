"""Handle / GroupHandle: states, wait with timeout, callbacks (incl. raising ones and threads),
results and exceptions, keepalive release."""
from __future__ import annotations

import threading
import time

import pytest

from collective.errors import HorovodInternalError, ShutdownError
from collective.handle import GroupHandle, Handle

pytestmark = pytest.mark.timeout(30)


def test_pending_then_result():
    h = Handle("allreduce.x", keepalive=[1, 2])
    assert not h.done() and h.exception() is None and "PENDING" in repr(h)
    h._set_result(42)
    assert h.done() and h.wait() == 42 and h.result() == 42 and h.wait(0) == 42
    assert h.keepalive is None  # tensors released once the op completed
    assert "FINISHED" in repr(h)


def test_wait_timeout_raises_timeout_error_naming_the_op():
    h = Handle("allreduce.slow")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="allreduce.slow"):
        h.wait(0.05)
    assert 0.04 <= time.monotonic() - t0 < 2.0
    assert not h.done()


def test_exception_is_raised_by_wait_and_kept():
    h = Handle("x")
    err = HorovodInternalError("boom")
    h._set_exception(err)
    assert h.done() and h.exception() is err
    with pytest.raises(HorovodInternalError, match="boom"):
        h.wait()


def test_first_completion_wins():
    h = Handle("x")
    h._set_result(1)
    h._set_exception(ShutdownError())
    h._set_result(2)
    assert h.wait() == 1 and h.exception() is None


def test_wait_wakes_from_another_thread():
    h = Handle("x")
    threading.Timer(0.05, h._set_result, args=("late",)).start()
    assert h.wait(5) == "late"


def test_callbacks_before_and_after_completion():
    seen = []
    h = Handle("x")
    h.add_done_callback(lambda hh: seen.append(("before", hh.wait())))
    h._set_result(7)
    h.add_done_callback(lambda hh: seen.append(("after", hh.wait())))
    assert seen == [("before", 7), ("after", 7)]


def test_raising_callback_is_logged_not_propagated(caplog):
    import logging
    logger = logging.getLogger("horovod")
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        h = Handle("cb")
        h.add_done_callback(lambda hh: 1 / 0)
        ok = []
        h.add_done_callback(lambda hh: ok.append(True))
        h._set_result(None)  # must not raise
        assert ok == [True]
        assert any("exception in callback of cb" in r.getMessage() for r in records)
    finally:
        logger.removeHandler(handler)


def test_group_handle_collects_results_in_member_order():
    members = [Handle(f"m{i}") for i in range(3)]
    g = GroupHandle("grouped", members)
    members[2]._set_result("c")
    members[0]._set_result("a")
    assert not g.done()
    members[1]._set_result("b")
    assert g.done() and g.wait(0) == ["a", "b", "c"]


def test_group_handle_fails_if_any_member_fails():
    members = [Handle("a"), Handle("b")]
    g = GroupHandle("grouped", members)
    members[0]._set_result(1)
    members[1]._set_exception(HorovodInternalError("member b failed"))
    with pytest.raises(HorovodInternalError, match="member b failed"):
        g.wait(1)


def test_group_handle_with_already_done_and_empty_members():
    done = Handle("d")
    done._set_result(5)
    assert GroupHandle("g", [done]).wait(0) == [5]
    assert GroupHandle("empty", []).wait(0) == []


def test_concurrent_member_completion():
    members = [Handle(f"m{i}") for i in range(200)]
    g = GroupHandle("g", members)
    threads = [threading.Thread(target=m._set_result, args=(i,), name=f"complete-{i}")
               for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert g.wait(5) == list(range(200))
