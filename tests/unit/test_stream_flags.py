"""`_stream_flags.StreamFlags`: device-side waits for device ops not launched yet.

The driver is replaced by a recorder over host memory (the words are real mapped-memory
stand-ins: numpy over a ctypes buffer); handles and results are the runtime's own classes.
"""
from __future__ import annotations

import ctypes
import threading

from collective.engines._stream_flags import StreamFlags
from collective.engines.device import DeviceResult
from collective.handle import Handle


class FakeOps:
    def __init__(self, wait_rc: int = 0, write_rc: int = 0) -> None:
        self.log: list[tuple] = []
        self.wait_rc, self.write_rc = wait_rc, write_rc
        self._bufs: list = []

    def alloc(self, nbytes: int) -> int:
        buf = (ctypes.c_char * nbytes)()
        self._bufs.append(buf)
        return ctypes.addressof(buf)

    def wait(self, stream: int, addr: int, value: int) -> int:
        self.log.append(("wait", stream, addr, value))
        return self.wait_rc

    def write(self, stream: int, addr: int, value: int) -> int:
        self.log.append(("write", stream, addr, value))
        if self.write_rc == 0:
            ctypes.c_uint32.from_address(addr).value = value  # the stream's write landing
        return self.write_rc


class FakeCompletion:
    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.log: list[tuple] = []

    def wait_on(self, stream: int) -> None:
        self.log.append(("wait_on", stream))

    def synchronize(self) -> None:
        self.log.append(("synchronize",))


def _word(addr: int) -> int:
    return ctypes.c_uint32.from_address(addr).value


def _launched(h: Handle, engine_stream: int = 77) -> FakeCompletion:
    done = FakeCompletion(engine_stream)
    h._set_result(DeviceResult("out", done))
    return done


def test_launched_op_signals_on_the_engine_stream_from_the_completing_thread():
    ops = FakeOps()
    flags = StreamFlags(ops, slots=8)
    h = Handle("bucket.a")
    finished = []
    assert flags.wait(h, stream=5, on_done=lambda: finished.append(1))
    (kind, stream, addr, value), = ops.log
    assert (kind, stream, value) == ("wait", 5, 1)
    assert _word(addr) == 0 and flags.pending() == 1
    t = threading.Thread(target=_launched, args=(h,))  # the coordinator thread
    t.start()
    t.join()
    assert ops.log[1] == ("write", 77, addr, 1)  # after the op, on the engine stream
    assert _word(addr) == 1 and flags.pending() == 0 and finished == [1]


def test_failed_op_releases_the_waiting_stream_from_the_host():
    ops = FakeOps()
    flags = StreamFlags(ops, slots=8)
    h = Handle("bucket.a")
    assert flags.wait(h, stream=5)
    addr = ops.log[0][2]
    t = threading.Thread(target=h._set_exception, args=(RuntimeError("peer died"),))
    t.start()
    t.join()
    assert [e[0] for e in ops.log] == ["wait"]  # no stream write for a failed op
    assert _word(addr) == 1 and flags.pending() == 0


def test_handle_done_while_registering_orders_the_stream_by_the_event():
    """The callback then runs on the registering thread: the op may have been followed by
    other ops on the engine stream, so the signal must not go there."""
    ops = FakeOps()
    flags = StreamFlags(ops, slots=8)
    h = Handle("bucket.a")
    done = _launched(h)
    assert flags.wait(h, stream=5)
    assert done.log == [("wait_on", 5)]
    assert [e[0] for e in ops.log] == ["wait"]
    assert _word(ops.log[0][2]) == 1


def test_a_refused_stream_write_falls_back_to_a_host_wait_for_the_op():
    ops = FakeOps(write_rc=1)
    flags = StreamFlags(ops, slots=8)
    h = Handle("bucket.a")
    assert flags.wait(h, stream=5)
    t = threading.Thread(target=_launched, args=(h,))
    t.start()
    t.join()
    done = h._result._done
    assert done.log == [("synchronize",)]  # the op finished before the word is released
    assert _word(ops.log[0][2]) == 1


def test_a_refused_wait_declines_and_disables():
    ops = FakeOps(wait_rc=801)  # CUDA_ERROR_NOT_SUPPORTED
    flags = StreamFlags(ops, slots=8)
    assert not flags.wait(Handle("a"), stream=5)
    assert flags.disabled and "801" in flags.disabled
    assert not flags.wait(Handle("b"), stream=5)
    assert len(ops.log) == 1 and flags.pending() == 0


def test_slots_are_reused_only_after_their_signal_landed_and_values_only_grow():
    ops = FakeOps()
    flags = StreamFlags(ops, slots=2)
    handles = [Handle(f"h{i}") for i in range(3)]
    assert flags.wait(handles[0], stream=5)
    assert flags.wait(handles[1], stream=5)
    assert not flags.wait(handles[2], stream=5)  # both slots await their signal: host waits
    _launched(handles[0])
    h = Handle("again")
    assert flags.wait(h, stream=5)
    first, again = ops.log[0], ops.log[-1]
    assert again[2] == first[2] and again[3] == first[3] + 1  # same slot, next value
    _launched(h)
    assert _word(first[2]) == 2


def test_values_wrap_modulo_2_32():
    ops = FakeOps()
    flags = StreamFlags(ops, slots=1)
    flags._issued[0] = 0xFFFFFFFF
    flags._words[0] = 0xFFFFFFFF
    h = Handle("wrap")
    assert flags.wait(h, stream=5)
    assert ops.log[0][3] == 0
    _launched(h)
    assert _word(ops.log[0][2]) == 0 and flags.pending() == 0
