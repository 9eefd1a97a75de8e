"""CUDA half of the torch tensor seam: CUDA tensors to NCCL-engine arguments and back.

`frameworks.torch._buffers` calls these for tensors on a CUDA device:

* `to_collective(tensor, output) -> (buffer, device, ready_event, output_buffer)`: a
  `DeviceBuffer` (pointer, bytes, shape, the tensor) for the input and the optional output,
  the device index, and a ready event recorded on the tensor device's current stream (the
  engine's stream waits on it, so work queued on any producer stream before the call is seen):
  a raw event from the engine's recycled pool (`collective.adapter.record_ready`), or a
  `torch.cuda.Event` before the engine is loaded. For a synchronous op (`sync=True`) an
  `OnStream` marker of that stream instead (`collective.adapter.on_stream`): the engine may run
  the op on the caller's stream, which then needs no ready event and no stream wait (one event
  recorded after the op stands for its completion). Outputs whose shape negotiation decides come
  from `allocate(shape, like)`, which allocates through torch's caching allocator on the
  stream the engine names (`collective.adapter.allocation_stream()`), so that memory
  the allocator recycles is never written by the engine while older work still uses it.
* `wrap_handle(handle) -> Handle`: the handle `_buffers.enqueue` returns for CUDA ops. Its
  `wait()` makes the caller's current stream wait on the op's completion event (no host
  block) and returns torch tensors (for alltoall `(output, received_splits)`, for grouped ops
  a list). Outputs the engine allocated get `record_stream` for the caller's stream.
* `from_collective(result, like) -> torch.Tensor`: a result (already a tensor after
  `wrap_handle`, or a `DeviceResult`/`DeviceBuffer`) as a torch tensor.

Nothing here imports CuPy: the engine owns every CUDA call except torch's own.
"""
from __future__ import annotations

from typing import Any

import torch

from collective import Handle
from collective.adapter import (DeviceBuffer, DeviceResult, allocation_stream, on_stream,
                                record_ready, waiting_hook)

__all__ = ["to_collective", "engine_view", "from_collective", "wrap_handle", "settle"]

_streams: dict[tuple[int, int], Any] = {}  # (stream handle, device) -> torch ExternalStream
# The current stream's handle without building a torch.cuda.Stream (a few µs per op).
_raw_current = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(dev: int) -> int:
    if _raw_current is not None:
        return int(_raw_current(dev))
    return torch.cuda.current_stream(dev).cuda_stream


def _buffer(t: torch.Tensor) -> DeviceBuffer:
    return DeviceBuffer(t.data_ptr(), t.nbytes, tuple(t.shape), t)


def allocate(shape: tuple, like: Any) -> DeviceBuffer:
    """Output allocation for the engine (coordinator thread), on the engine's stream."""
    ref = like.obj if type(like) is DeviceBuffer else like
    sp = allocation_stream()
    if not sp:
        return _buffer(torch.empty(shape, dtype=ref.dtype, device=ref.device))
    key = (sp, ref.device.index)
    ext = _streams.get(key)
    if ext is None:
        ext = _streams[key] = torch.cuda.ExternalStream(sp, device=ref.device)
    with torch.cuda.stream(ext):
        return _buffer(torch.empty(shape, dtype=ref.dtype, device=ref.device))


def to_collective(tensor: torch.Tensor, output: torch.Tensor | None = None, sync: bool = False
                  ) -> tuple[DeviceBuffer, int, Any, DeviceBuffer | None]:
    """(input buffer, device index, ready event, output buffer or None) for a contiguous CUDA
    tensor (see the module docstring); `_buffers.to_collective` makes the enqueue arguments.
    `sync`: for an op the caller waits for at once (`_buffers.run_one`): the ready event may be
    an `OnStream` marker of the current stream, on which the engine can run the op itself.

    Raises:
        ValueError: `output` is on another device than `tensor`.
    """
    dev = tensor.get_device()
    buf = _buffer(tensor)
    out = None
    if output is not None:
        if output is tensor:
            out = buf
        elif output.get_device() != dev:
            raise ValueError(f"output on {output.device} for an input on {tensor.device}")
        else:
            out = _buffer(output)
    if sync:
        marker = on_stream(dev, _current_stream(dev))
        if marker is not None:
            return buf, dev, marker, out
    return buf, dev, _ready_event(dev), out


def _ready_event(dev: int) -> Any:
    """An event recorded now on `dev`'s current stream: the engine's recycled raw event once
    it is loaded (cheaper), a torch event before."""
    ev = record_ready(dev, _current_stream(dev))
    if ev is None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
    return ev


def engine_view(tensor: torch.Tensor) -> tuple[DeviceBuffer, Any]:
    """(buffer, ready event) of a contiguous CUDA tensor, as `to_collective` without an
    output (a gradient set's submit)."""
    return _buffer(tensor), _ready_event(tensor.get_device())


_stream_objects: dict[tuple[int, int], Any] = {}  # (raw handle, device) -> torch.cuda.Stream


def _stream_object(dev: int) -> Any:
    """The current stream of `dev` as a torch object, cached by its raw handle
    (`torch.cuda.current_stream` builds a new object each call)."""
    if _raw_current is None:
        return torch.cuda.current_stream(dev)
    key = (int(_raw_current(dev)), dev)
    s = _stream_objects.get(key)
    if s is None:
        if len(_stream_objects) > 256:  # streams come and go (e.g. per-iteration side streams)
            _stream_objects.clear()
        s = _stream_objects[key] = torch.cuda.current_stream(dev)
    return s


def settle(result: Any) -> Any:
    """Orders the caller's current stream after the op and unwraps torch tensors."""
    if type(result) is DeviceResult:
        out = result.output
        t = out.obj if type(out) is DeviceBuffer else out
        if isinstance(t, torch.Tensor):
            dev = t.get_device()
            result.wait(_current_stream(dev), dev)
            if result.allocated:
                t.record_stream(_stream_object(dev))
        else:  # a CuPy array (zeros of a joined rank): order on the device's current stream
            result.synchronize()
        if result.kind == "alltoall":
            return t, result.received_splits
        return t
    if type(result) is list:
        return [settle(r) for r in result]
    return result


def from_collective(result: Any, like: torch.Tensor) -> torch.Tensor:
    """A device result as a torch tensor of `like`'s dtype on `like`'s device."""
    t = settle(result)
    if type(t) is DeviceBuffer:
        t = t.obj
    if not isinstance(t, torch.Tensor):  # e.g. a CuPy array from a joined rank's zeros
        t = torch.as_tensor(t, device=like.device)
        if like.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
    return t


class _OrderedHandle(Handle):
    """A CUDA op's handle: `wait()` orders the caller's stream and returns torch tensors."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Handle) -> None:  # noqa: D107
        self._inner = inner  # shares the inner handle's state
        self.name = inner.name

    _settle = staticmethod(settle)

    def __repr__(self) -> str:
        return repr(self._inner)

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        inner = self._inner
        if inner.done():
            return self._settle(inner.wait())
        # Tell the coordinator someone blocks on device work, so it negotiates at once
        # instead of letting device requests collect for its fusion window.
        waiting = waiting_hook()
        if waiting is None:
            return self._settle(inner.wait(timeout))
        waiting(1)
        try:
            # Not `coord.drive()`: the submit already woke the coordinator thread, and two
            # threads active at once trade the GIL at every CUDA call (measured: pipelined
            # allreduces slower). Synchronous functions run their ops themselves
            # (`collective.adapter.wait_now`).
            result = inner.wait(timeout)
        finally:
            waiting(-1)
        return self._settle(result)

    result = wait

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def add_done_callback(self, fn: Any) -> None:
        self._inner.add_done_callback(lambda _h: fn(self))

    def _set_result(self, result: Any) -> None:
        self._inner._set_result(result)

    def _set_exception(self, exc: BaseException) -> None:
        self._inner._set_exception(exc)


def wrap_handle(handle: Handle) -> Handle:
    """The handle of a CUDA op, as returned to adapter code (see the module docstring)."""
    return _OrderedHandle(handle)
