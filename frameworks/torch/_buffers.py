"""The one place where torch tensors become `adapter.enqueue` arguments and results become
torch tensors again.

Host (CPU) tensors travel as numpy views that share the tensor's memory, so in-place ops write
straight into the user's tensor and results wrap engine-allocated numpy arrays without a copy.
bfloat16 has no numpy dtype: it travels as a uint16 view tagged `DataType.BFLOAT16` (the host
engines upcast to float32 to reduce). CUDA tensors are handed to `frameworks.torch._cuda`; nothing
else in the adapter knows about devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from collective import DataType, Handle, ProcessSet, ReduceOp, RequestType
from collective import adapter
from collective.adapter import DeviceOpError
from collective.adapter import run_one as _run_one

from . import _cuda  # torch-only (no CuPy); imported here, not per call

__all__ = ["CollectiveArgs", "dtype_of", "check_tensor", "to_collective", "engine_view",
           "from_collective", "enqueue", "run_one", "CPU_DEVICE"]

CPU_DEVICE = -1

_DTYPES: dict[torch.dtype, DataType] = {
    torch.uint8: DataType.UINT8, torch.int8: DataType.INT8, torch.int16: DataType.INT16,
    torch.int32: DataType.INT32, torch.int64: DataType.INT64,
    torch.float16: DataType.FLOAT16, torch.bfloat16: DataType.BFLOAT16,
    torch.float32: DataType.FLOAT32, torch.float64: DataType.FLOAT64, torch.bool: DataType.BOOL,
}


@dataclass(slots=True)
class CollectiveArgs:
    """What `adapter.enqueue` needs for one tensor.

    Attributes:
        tensor: the engine's view of the input (numpy array on the host; the CUDA engine's
            device-tensor object otherwise).
        dtype: wire dtype.
        shape: the tensor's shape.
        device: -1 for host memory, else the local CUDA ordinal.
        ready_event: device ops: an event recorded on the producer's stream (None on the host).
        allocate: `allocate(shape, like)` for outputs whose shape negotiation decides; None =
            collective's numpy default.
        output: the engine's view of a preallocated output (None = allocate).
    """

    tensor: Any
    dtype: DataType
    shape: tuple[int, ...]
    device: int
    ready_event: Any = None
    allocate: Callable[[tuple, Any], Any] | None = None
    output: Any = None


def dtype_of(tensor: torch.Tensor) -> DataType:
    """The wire dtype of a torch tensor.

    Raises:
        ValueError: the dtype has no ringvod equivalent (complex, uint16/32/64, float8, ...).
    """
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.") from None


def check_tensor(tensor: Any) -> None:
    """Checks what every op requires of its tensor arguments.

    Raises:
        TypeError: not a torch.Tensor.
        ValueError: sparse, not contiguous, or an unsupported dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{tensor.layout} tensors are not supported here; use "
                         "sparse_allreduce_async for sparse tensors, or .to_dense().")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    dtype_of(tensor)


def _host_view(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach() if tensor.requires_grad else tensor  # detach() makes a new tensor
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


_STRIDED = torch.strided


def to_collective(tensor: torch.Tensor, output: torch.Tensor | None = None,
                  sync: bool = False) -> CollectiveArgs:
    """Turns a torch tensor (and an optional preallocated output) into enqueue arguments.

    `sync`: the caller waits for the op at once (`run_one`); see `_cuda.to_collective`.

    Raises:
        TypeError / ValueError: see `check_tensor`; the output's device differs from the input's.
        NotImplementedError: CUDA tensors without the NCCL engine's adapter half.
    """
    # Runs once per op: the checks of `check_tensor` in their cheapest form, which then only
    # runs to name what is wrong.
    if not isinstance(tensor, torch.Tensor):
        check_tensor(tensor)
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None or tensor.layout is not _STRIDED or not tensor.is_contiguous():
        check_tensor(tensor)
    if tensor.is_cuda:
        buf, dev, ev, out = _cuda.to_collective(tensor, output, sync)
        return CollectiveArgs(buf, dtype, buf.shape, dev, ev, _cuda.allocate, out)
    if not tensor.is_cpu:
        raise ValueError(f"tensors on {tensor.device} are not supported; use CPU or CUDA "
                         "tensors")
    if output is not None and not output.is_cpu:
        raise ValueError(f"output on {output.device} for an input on the CPU")
    view = _host_view(tensor)
    # In-place ops pass the very same view as output: engines test `output is tensor`.
    out = None if output is None else view if output is tensor else _host_view(output)
    return CollectiveArgs(view, dtype, view.shape, CPU_DEVICE, None, None, out)


def engine_view(tensor: torch.Tensor) -> tuple[Any, Any]:
    """(engine view, ready event) of a contiguous tensor whose dtype the caller checked: what
    a gradient set is handed per gradient (`to_collective` without the checks and the
    argument record). The ready event is None for host tensors."""
    if tensor.is_cuda:
        return _cuda.engine_view(tensor)
    return _host_view(tensor), None


def from_collective(result: Any, like: torch.Tensor) -> torch.Tensor:
    """Wraps an engine result (numpy array or device tensor) as a torch tensor of `like`'s
    dtype and device. Host results are wrapped without a copy."""
    if isinstance(result, torch.Tensor):
        return result
    if like.device.type == "cuda":
        return _cuda.from_collective(result, like)
    out = torch.from_numpy(result)
    if like.dtype == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return out


def enqueue(kind: RequestType, tensors: Sequence[torch.Tensor], *,
            outputs: Sequence[torch.Tensor] | None = None, **kwargs: Any) -> Handle:
    """`adapter.enqueue` for torch tensors (all on one device).

    Raises:
        DeviceOpError (a ValueError and RuntimeError): tensors on different devices.
        ValueError: any `to_collective`/`enqueue` error.
    """
    # Most ops have one tensor: skipping the five per-tensor lists below saves about a tenth
    # of this function's time (timeit).
    if len(tensors) == 1:
        a = to_collective(tensors[0], None if outputs is None else outputs[0])
        device = a.device
        h = adapter.enqueue(
            kind, (a.tensor,), dtypes=(a.dtype,), shapes=(a.shape,), device=device,
            ready_events=None if device == CPU_DEVICE else (a.ready_event,),
            allocate=a.allocate, outputs=None if outputs is None else (a.output,), **kwargs)
        if device != CPU_DEVICE:
            h = _cuda.wrap_handle(h)
        return h
    args = [to_collective(t, outputs[i] if outputs is not None else None)
            for i, t in enumerate(tensors)]
    device = args[0].device if args else CPU_DEVICE
    if any(a.device != device for a in args):
        raise DeviceOpError("all tensors of one grouped op must be on the same device; got "
                            + ", ".join(str(t.device) for t in tensors))
    h = adapter.enqueue(
        kind, [a.tensor for a in args],
        dtypes=[a.dtype for a in args], shapes=[a.shape for a in args], device=device,
        ready_events=None if device == CPU_DEVICE else [a.ready_event for a in args],
        allocate=args[0].allocate if args else None,
        outputs=None if outputs is None else [a.output for a in args],
        **kwargs)
    if device != CPU_DEVICE:  # wait() must order the caller's stream after the op
        h = _cuda.wrap_handle(h)
    return h


def run_one(kind: RequestType, tensor: torch.Tensor, output: torch.Tensor | None,
            name: str | None, process_set: ProcessSet, op: ReduceOp = ReduceOp.SUM,
            prescale: float = 1.0, postscale: float = 1.0, root: int = -1) -> Any:
    """`collective.adapter.run_one` for a torch tensor (the synchronous single-tensor functions):
    runs the op and waits; for a CUDA tensor the caller's stream is ordered after the op and
    the result is a torch tensor, for a host tensor it is the engine's numpy result.

    Raises:
        as `to_collective` and `adapter.enqueue`; HorovodInternalError: the op failed.
    """
    a = to_collective(tensor, output, sync=True)
    res = _run_one(kind, a.tensor, a.output, name, process_set, op, prescale, postscale, root,
                   a.dtype, a.shape, a.device, a.ready_event, a.allocate)
    return res if a.device == CPU_DEVICE else _cuda.settle(res)
