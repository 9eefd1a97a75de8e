"""Device tensors as the NCCL engine sees them, and what a device op's handle yields.

No CuPy here: adapters import this module to build `DeviceBuffer`s and to unwrap
`DeviceResult`s, whether or not a GPU engine was ever created.

The protocol between an adapter and the NCCL engine (`collective/engines/nccl/`):

* a device tensor is a `DeviceBuffer` (pointer, byte count, shape, the framework's object) or
  any C-contiguous object exposing `__cuda_array_interface__` (a CuPy array);
* `Entry.ready_event` is a CUDA event recorded on the producer's stream after the tensor was
  written: a raw `cudaEvent_t` (int), an object with `.cuda_event` (`torch.cuda.Event`) or with
  `.ptr` (`cupy.cuda.Event`); None when the tensor needs no ordering. `record_ready` gives
  adapters one from the engine's pool once the engine is loaded (recycled after use).
  A synchronous op (one the caller waits for at once, `collective.ops.run_one`) may carry an
  `OnStream` marker instead: the tensor is ready in the order of the caller's current stream,
  and the engine may run the op on that stream itself (no ready event, nothing for the
  caller's stream to wait on); where it does not, a ready event is recorded on that stream
  then (`ready_now`, or the engine when it runs the op);
* `Entry.allocate(shape, like)` makes an output on the tensor's device. The engine calls it with
  its own stream made the *allocation stream* (`allocation_stream()`), so that an allocator with
  per-stream pools (PyTorch's caching allocator) hands out memory that is safe to write on the
  engine's stream (an op run on the caller's stream allocates on that stream);
* the handle's result is a `DeviceResult`: the output object plus a completion event on the
  engine's stream (on the caller's stream for an op run there). `wait(stream)` makes the
  caller's stream wait on it (no host block; nothing for the stream the op ran on);
  `value()` is what the numpy API would return (the output, or (output, received_splits)).
"""
from __future__ import annotations

import threading
from typing import Any

from ..errors import CollectiveError

__all__ = ["DeviceBuffer", "DeviceResult", "DeviceOpError", "OnStream", "allocation_stream",
           "set_allocation_stream", "pointer_of", "record_ready", "release_ready",
           "set_ready_events", "release_events", "on_stream", "ready_now"]

# Synchronous device ops may run on the caller's stream (`OnStream`); False: every device op
# runs on the engine's stream behind a ready event (benchmarks compare the two).
CALLER_STREAM = True
_PER_THREAD_STREAM = 2  # cudaStreamPerThread



class DeviceOpError(CollectiveError, ValueError, RuntimeError):
    """An op the device path cannot run as asked: tensors of one grouped op on the CPU and on a
    GPU, or a dtype/op NCCL has no kernel for. Horovod reports these as a `RuntimeError`, which
    scripts catch; it is a `ValueError` too, as ringvod raised before."""


class _AllocTLS(threading.local):
    stream: int = 0  # a class default: reading an unset thread-local attribute raises inside


_tls = _AllocTLS()


class DeviceBuffer:
    """A contiguous device tensor: `ptr` (int), `nbytes`, `shape` and the owning object `obj`.

    `obj` keeps the memory alive while the engine uses it; adapters get it back in results.
    """

    __slots__ = ("ptr", "nbytes", "shape", "obj")

    def __init__(self, ptr: int, nbytes: int, shape: tuple[int, ...], obj: Any) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.shape = shape
        self.obj = obj

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, shape={self.shape})"


def pointer_of(t: Any) -> tuple[int, int]:
    """(device pointer, byte count) of a `DeviceBuffer` or a `__cuda_array_interface__` object.

    Raises:
        ValueError: the object is not a device tensor, or it is not C-contiguous.
    """
    if type(t) is DeviceBuffer:
        return t.ptr, t.nbytes
    try:
        cai = t.__cuda_array_interface__
    except AttributeError:
        raise ValueError(f"{type(t).__name__} is not a device tensor (it has neither a "
                         "DeviceBuffer wrapper nor __cuda_array_interface__)") from None
    shape = tuple(cai["shape"])
    item = int(cai["typestr"][2:])
    n = 1
    for d in shape:
        n *= d
    strides = cai.get("strides")
    if strides is not None and n > 1:
        expect, ok = item, True
        for d, s in zip(reversed(shape), reversed(strides)):
            if d != 1 and s != expect:
                ok = False
                break
            expect *= d
        if not ok:
            raise ValueError("Tensor is required to be contiguous.")
    return int(cai["data"][0]), n * item


class DeviceResult:
    """The result of a device op. Only the engine builds it; adapters unwrap it.

    Attributes:
        output: the output object (what `Entry.allocate` returned, the preallocated output, or
            a CuPy array).
        received_splits: alltoall only: rows received from each rank (np.int32), else None.
        allocated: True when the engine allocated the output (on its own stream).
    """

    __slots__ = ("output", "received_splits", "allocated", "kind", "_done")

    def __init__(self, output: Any, done: Any, kind: str | None = None,
                 received_splits: Any = None, allocated: bool = False) -> None:
        self.output = output
        self.received_splits = received_splits
        self.allocated = allocated
        self.kind = kind
        self._done = done

    def wait(self, stream: int, device: int = -1) -> None:
        """Makes the CUDA stream `stream` (a `cudaStream_t` as int) of `device` wait for the op.
        Async. Pass `device` whenever `stream` may be 0 (a device's default stream): handle 0
        means the current device's, which need not be the tensor's."""
        self._done.wait_on(stream, device)

    def synchronize(self) -> None:
        """Blocks the host until the op finished on the device."""
        self._done.synchronize()

    def done(self) -> bool:
        """True once the op finished on the device (never blocks)."""
        return self._done.query()

    def value(self) -> Any:
        """The numpy-API-shaped result: the output, or (output, received_splits)."""
        if self.kind == "alltoall":
            return self.output, self.received_splits
        return self.output


def allocation_stream() -> int:
    """The stream (int handle) the calling thread should allocate device outputs on; 0 = current.

    The NCCL engine sets it on the coordinator thread around `Entry.allocate` calls.
    """
    return _tls.stream


def set_allocation_stream(stream: int) -> None:
    """Sets this thread's allocation stream (0 clears it). For engines only."""
    _tls.stream = stream


# The NCCL engine's ready-event pool (`nccl.events._ReadyEvents`), installed when that module loads.
_ready_events: Any = None


def record_ready(device: int, stream: int) -> int | None:
    """A ready event (raw `cudaEvent_t`) recorded on `stream` (a `cudaStream_t` as int) of
    `device`, recycled by the engine once its stream waits on it; None until the NCCL engine
    is loaded (the adapter then records an event of its own). Any thread."""
    pool = _ready_events
    return None if pool is None else pool.record(device, stream)


def release_ready(entries: Any) -> None:
    """Gives back the pooled ready events of ops that failed before the engine ran them (a
    mismatch, shutdown), which would otherwise be lost to the pool: each event once, also one
    that several entries share. Coordinator thread."""
    pool = _ready_events
    if pool is None:
        return
    seen = set()
    for e in entries:
        ev = e.ready_event
        if type(ev) is int:
            e.ready_event = None  # once only
            if ev not in seen:
                seen.add(ev)
                pool.release(ev)


def release_events(events: Any) -> None:
    """Gives back pooled ready events (raw ints) that no op will wait on (None and events not
    from the pool are skipped). Any thread."""
    pool = _ready_events
    if pool is None:
        return
    for ev in events:
        if type(ev) is int:
            pool.release(ev)


class OnStream:
    """`Entry.ready_event` of a synchronous op: the tensor is ready in the order of `stream`
    (a `cudaStream_t` as int) of `device`, the calling thread's current stream, on which the
    caller orders itself after the op anyway. See the module docstring."""

    __slots__ = ("stream", "device")

    def __init__(self, stream: int, device: int) -> None:
        self.stream = stream
        self.device = device

    def __repr__(self) -> str:
        return f"OnStream(stream=0x{self.stream:x}, device={self.device})"


def on_stream(device: int, stream: int) -> OnStream | None:
    """The marker for a synchronous op's tensor on `stream` of `device`; None (record a ready
    event instead) before the NCCL engine is loaded, with `CALLER_STREAM` off, or for the
    per-thread default stream (handle 2 means another stream on each thread, and the op may
    run on another thread than its caller's)."""
    if _ready_events is None or not CALLER_STREAM or stream == _PER_THREAD_STREAM:
        return None
    return OnStream(stream, device)


def ready_now(entry: Any) -> None:
    """Replaces an `OnStream` marker by a ready event recorded on its stream now, for an op
    that is queued for a cycle instead of taking the express lane (any thread may record on
    a marker's stream: `on_stream` makes none for the per-thread default stream)."""
    ev = entry.ready_event
    if type(ev) is OnStream:
        entry.ready_event = _ready_events.record(ev.device, ev.stream)


def set_ready_events(pool: Any) -> None:
    """For the NCCL engine: installs its ready-event pool."""
    global _ready_events
    _ready_events = pool
