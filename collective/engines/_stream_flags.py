"""Device-side waits for ops the coordinator has not launched yet (`device.wait_on_device`).

A caller that needs an op's result only on the GPU (DistributedOptimizer's `step()`: unpack the
reduced bucket, then the optimizer's kernels) would otherwise block the host until the
coordinator has negotiated and launched the op, since a CUDA event can be waited on only once
it is recorded. Instead the caller's stream waits for a 32-bit word in mapped pinned host
memory (`cuStreamWaitValue32`, "stream memory operations" of the CUDA driver) and goes on at
once; when the op's handle completes the word is written:

* the op launched: on the engine's stream right after the op (`cuStreamWriteValue32`, which
  orders the op's writes before it), by the thread that launched it, before it launches
  anything else, so no later op of the engine stream sits between the op and the signal;
* the op failed (a mismatch, a dead peer, shutdown): from the host at once, so that no stream
  waits forever; the caller learns the error from the handle (DistributedOptimizer raises it
  before the next step reduces the same bucket);
* the handle completed while the waiter was registering (the callback runs on the registering
  thread): the caller's stream also waits on the op's completion event, enqueued after the
  word's wait, and the word is written from the host.

Each slot's value only grows (waits use "greater or equal", which CUDA compares modulo 2^32),
and a slot is handed out again only once its last signal has landed, so a late write can never
undo a newer one. Where the driver lacks stream memory operations, `wait` declines and the
caller blocks on the host as before.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from .device import DeviceResult

SLOTS = 4096
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: earlier work's writes are visible first
_MASK = 0xFFFFFFFF


class DriverOps:
    """The CUDA driver's 32-bit stream wait/write and mapped pinned memory (through CuPy).

    Raises:
        OSError: no CUDA driver library, or it lacks the functions.
    """

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = self._fn(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._write = self._fn(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")

    @staticmethod
    def _fn(lib: Any, *names: str) -> Any:
        for name in names:
            f = getattr(lib, name, None)
            if f is not None:
                f.restype = ctypes.c_int
                f.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
                return f
        raise OSError(f"the CUDA driver has none of {names}")

    def alloc(self, nbytes: int) -> int:
        """Pinned host memory mapped into every device's address space (with unified
        addressing the device address is the host address)."""
        rt = self._rt
        return int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))

    def wait(self, stream: int, addr: int, value: int) -> int:
        return int(self._wait(stream, addr, value, _WAIT_GEQ))

    def write(self, stream: int, addr: int, value: int) -> int:
        return int(self._write(stream, addr, value, _WRITE_DEFAULT))


class StreamFlags:
    """Slots of mapped pinned memory that streams wait on until an op's handle completes."""

    def __init__(self, ops: Any, slots: int = SLOTS) -> None:
        self._ops = ops
        self._n = slots
        self._base = ops.alloc(slots * 4)
        self._words = np.frombuffer((ctypes.c_uint32 * slots).from_address(self._base),
                                    dtype=np.uint32)
        self._words[:] = 0
        self._issued = [0] * slots  # the last value handed out per slot
        self._next = 0
        self._lock = threading.Lock()
        self.disabled: str | None = None  # why waits are declined (a driver call failed)

    def _acquire(self) -> tuple[int, int] | None:
        words, issued = self._words, self._issued
        with self._lock:
            for _ in range(self._n):
                i = self._next
                self._next = (i + 1) % self._n
                if int(words[i]) == issued[i]:  # its last signal landed: reusable
                    v = issued[i] = (issued[i] + 1) & _MASK
                    return i, v
        return None  # every slot awaits its signal: the caller blocks instead

    def wait(self, handle: Any, stream: int, on_done: Any = None) -> bool:
        """Makes `stream` wait for `handle` (a pending handle of a device op) without blocking
        the host. False: not possible here (the caller waits on the host instead).
        `on_done()`, if given, runs once the handle completed and its signal is on its way."""
        if self.disabled is not None:
            return False
        got = self._acquire()
        if got is None:
            return False
        i, v = got
        addr = self._base + 4 * i
        rc = self._ops.wait(stream, addr, v)
        if rc != 0:
            self._words[i] = v  # nothing waits on it: the slot is free again
            self.disabled = f"cuStreamWaitValue32 returned CUDA error {rc}"
            return False
        me = threading.get_ident()

        def signal(h: Any) -> None:
            try:
                self._signal(h, i, v, addr, stream if threading.get_ident() == me else None)
            finally:
                if on_done is not None:
                    on_done()
        handle.add_done_callback(signal)
        return True

    def _signal(self, h: Any, i: int, v: int, addr: int, inline_stream: int | None) -> None:
        res = h._result if h.exception() is None else None
        if type(res) is DeviceResult:
            done = res._done
            if inline_stream is not None:
                # The handle completed before it had our callback, which now runs on the
                # registering thread: order the stream by the op's event after the word's
                # wait, then release the word.
                done.wait_on(inline_stream)
            elif self._ops.write(done.stream, addr, v) == 0:
                return
            else:  # the driver refused the write: learn on the host that the op finished
                done.synchronize()
        self._words[i] = v  # failed ops, and the cases above: release the stream now

    def pending(self) -> int:
        """Slots whose signal has not landed (for tests and diagnostics)."""
        with self._lock:
            return sum(1 for i in range(self._n) if int(self._words[i]) != self._issued[i])
