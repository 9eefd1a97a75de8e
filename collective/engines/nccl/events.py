"""CUDA events of the NCCL engine: the completion event an op's results share
(`_Completion`), and the pool of ready events adapters record on their producer's stream
(`_ReadyEvents`, installed into `collective.engines.device` when this module loads)."""
from __future__ import annotations

from typing import Any, Callable

import cupy

from ..device import set_ready_events

__all__ = ["_Completion", "_StreamDone", "_ReadyEvents", "_on_device", "_event_ptr"]

_rt = cupy.cuda.runtime


class _Completion:
    """The completion event of one op, shared by the results of its entries."""

    __slots__ = ("event", "_waited")

    def __init__(self, event: Any) -> None:
        self.event = event
        self._waited: int | None = None  # the last stream made to wait (waiting twice is moot)

    def wait_on(self, stream: int, device: int = -1) -> None:
        # Handle 0 is the legacy default stream of the *current* device, so it is one stream
        # per device: remembered as ~device.
        key = stream if stream else ~device
        if key == self._waited:
            return
        if stream == 0 and device >= 0:
            # Make the waiting stream's device current (a stream may wait on another
            # device's event).
            _on_device(device, _rt.streamWaitEvent, stream, self.event.ptr, 0)
        else:
            _rt.streamWaitEvent(stream, self.event.ptr, 0)
        self._waited = key

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.done)


class _StreamDone:
    """The completion of an op the engine ran on the caller's stream (`OnStream`): done in that
    stream's order, and marked by `event`, recorded right after it (the engine re-records that
    event after each such op: a wait made later may cover a later op too, never less).
    Waiting from the same stream costs nothing."""

    __slots__ = ("stream", "device", "event")

    def __init__(self, stream: int, device: int, event: int) -> None:
        self.stream = stream
        self.device = device
        self.event = event

    def wait_on(self, stream: int, device: int = -1) -> None:
        if stream == self.stream and (stream or device in (-1, self.device)):
            return
        if stream == 0 and device >= 0:
            _on_device(device, _rt.streamWaitEvent, stream, self.event, 0)
        else:
            _rt.streamWaitEvent(stream, self.event, 0)

    def synchronize(self) -> None:
        _rt.eventSynchronize(self.event)

    def query(self) -> bool:
        return _rt.eventQuery(self.event) == 0


def _on_device(device: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with `device` current on this thread (restored after): event records and
    stream handle 0 refer to the current device, and the caller's tensor may live elsewhere
    (a rank that places tensors with `t.cuda(local_rank)` without `set_device`)."""
    prev = int(_rt.getDevice())
    if prev == device:
        return fn(*args)
    _rt.setDevice(device)
    try:
        return fn(*args)
    finally:
        _rt.setDevice(prev)


_DISABLE_TIMING = 2  # cudaEventDisableTiming
_READY_KEEP = 1024  # free ready events kept per device


class _ReadyEvents:
    """Ready events for adapters (`collective.engines.device.record_ready`): raw CUDA events
    recorded on the producer's stream at enqueue, from a free list per device. The engine
    hands one back (`release`) as soon as its stream waits on it: a later record cannot change
    a wait already enqueued. Recording a recycled raw event costs a fraction of creating and
    recording a torch.cuda.Event (one CUDA call instead of object set-up). Events of
    ops that fail before the engine runs them (a mismatch, shutdown) come back through
    `device.release_ready`."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._device_of: dict[int, int] = {}  # events made here -> their device

    def record(self, device: int, stream: int) -> int:
        try:
            ev = self._free[device].pop()  # list.pop is atomic: enqueueing threads share this
        except (KeyError, IndexError):
            ev = self._create(device)
        # The event and the stream must be on one device, and `stream` may be 0 (the current
        # device's default stream): record with `device` current.
        _on_device(device, _rt.eventRecord, ev, stream)
        return ev

    def _create(self, device: int) -> int:
        ev = int(_on_device(device, _rt.eventCreateWithFlags, _DISABLE_TIMING))
        self._free.setdefault(device, [])
        self._device_of[ev] = device
        return ev

    def release(self, ev: int) -> None:
        dev = self._device_of.get(ev)
        if dev is None:  # not ours (a caller's own event)
            return
        free = self._free[dev]
        if len(free) < _READY_KEEP:
            free.append(ev)
        else:
            del self._device_of[ev]
            _rt.eventDestroy(ev)


_ready = _ReadyEvents()
set_ready_events(_ready)


def _event_ptr(ev: Any) -> int:
    if type(ev) is int:
        return ev
    h = getattr(ev, "cuda_event", None)
    if h is None:
        h = ev.ptr
    return int(h)
