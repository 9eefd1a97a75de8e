"""Collectives on torch tensors: the async, in-place and control functions of `horovod.torch`.

Async functions return an int handle (as Horovod); `poll(handle)` never blocks and
`synchronize(handle)` waits and returns torch tensors. `_` variants write into their input.
The differentiable out-of-place functions (`allreduce`, `allgather`, ...) are in `autograd.py`.

Dtypes: ringvod accepts uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64 and
bool for every op (Horovod refuses bfloat16, bool, and 8-bit allreduce); Average of bool raises.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

import collective
from collective.adapter import reducescatter_op, wait_now as _collective_wait_now
from collective import (Handle, ProcessSet, ReduceOp, RequestType,
                        global_process_set, resolve_op)

from .._common import process_set_rank, process_set_size
from ._buffers import enqueue, from_collective, run_one
from ._handles import handles

__all__ = [
    "init", "shutdown", "allreduce_async", "allreduce_async_", "allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allreduce_",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
    "broadcast_", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "sparse_allreduce_async", "barrier", "join", "poll", "synchronize", "process_set_size",
    "process_set_rank",
]

Tensors = Sequence[torch.Tensor]


# -- lifecycle ----------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Starts ringvod (idempotent) and forgets int handles of an earlier run.

    Args:
        comm: None (whole job), a list of world ranks, or an mpi4py communicator.
        process_sets: None, a list of `ProcessSet`, or "dynamic".

    Raises:
        ValueError: invalid process sets.
        EngineUnavailableError: the detected mode needs a package that is not installed.
    """
    collective.init(comm=comm, process_sets=process_sets)
    handles.clear()


def shutdown() -> None:
    """Stops ringvod on this rank; `init()` may be called again."""
    collective.shutdown()
    handles.clear()




def _add(handle: Handle, finish: Callable[[Any], Any], *keep: Any) -> int:
    return handles.add(handle, finish, *keep)


# -- allreduce ----------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts reducing `tensor` across the process set into a new tensor; returns a handle.
    A CUDA tensor of 64 MiB or more (`collective.ops.EAGER_BYTES`) is negotiated and launched
    before the call returns, once every rank has taken part in that round (docs/torch.md).

    Raises:
        ValueError: not initialised, unsupported dtype, non-contiguous tensor, duplicate pending
            name, or both `op` and `average` given.
    """
    op = resolve_op(op, average)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    h = enqueue(RequestType.ALLREDUCE, [tensor], outputs=[output], name=name,
                process_set=process_set, op=op, prescale=prescale_factor,
                postscale=postscale_factor, eager=True)
    return _add(h, lambda _: output, tensor, output)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place `allreduce_async`: the result overwrites `tensor` (see its Raises)."""
    op = resolve_op(op, average)
    h = enqueue(RequestType.ALLREDUCE, [tensor], outputs=[tensor], name=name,
                process_set=process_set, op=op, prescale=prescale_factor,
                postscale=postscale_factor, eager=True)
    return _add(h, lambda _: tensor, tensor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`.

    Raises:
        HorovodInternalError: the op failed on some rank (plus `allreduce_async`'s errors).
    """
    run_one(RequestType.ALLREDUCE, tensor, tensor, name, process_set, resolve_op(op, average),
            prescale_factor, postscale_factor)
    return tensor


def grouped_allreduce_async(tensors: Tensors, average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Starts an atomic allreduce of a list (negotiated and fused together); returns a handle.

    Raises:
        ValueError: as `allreduce_async`, or tensors on different devices.
    """
    op = resolve_op(op, average)
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    h = enqueue(RequestType.ALLREDUCE, list(tensors), outputs=outputs, name=name,
                process_set=process_set, op=op, prescale=prescale_factor,
                postscale=postscale_factor, grouped=True)
    return _add(h, lambda _: outputs, tuple(tensors), outputs)


def grouped_allreduce_async_(tensors: Tensors, average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place `grouped_allreduce_async`."""
    op = resolve_op(op, average)
    ts = list(tensors)
    h = enqueue(RequestType.ALLREDUCE, ts, outputs=ts, name=name, process_set=process_set,
                op=op, prescale=prescale_factor, postscale=postscale_factor, grouped=True)
    return _add(h, lambda _: ts, ts)


def grouped_allreduce_(tensors: Tensors, average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the tensors."""
    return wait_now(grouped_allreduce_async_, tensors, average, name, op, prescale_factor,
                    postscale_factor, process_set)


# -- allgather / broadcast / alltoall / reducescatter ---------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's tensor along dim 0 (dim-0 sizes may differ)."""
    h = enqueue(RequestType.ALLGATHER, [tensor], name=name, process_set=process_set)
    return _add(h, lambda r: from_collective(r, tensor), tensor)


def grouped_allgather_async(tensors: Tensors, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """List form of `allgather_async`; the result is a list."""
    ts = list(tensors)
    h = enqueue(RequestType.ALLGATHER, ts, name=name, process_set=process_set, grouped=True)
    return _add(h, lambda rs: [from_collective(r, t) for r, t in zip(rs, ts)], ts)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Starts copying global rank `root_rank`'s tensor into a new tensor on every rank.

    Raises:
        ValueError: root not in the process set (plus the common errors).
    """
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    h = enqueue(RequestType.BROADCAST, [tensor], outputs=[output], name=name,
                process_set=process_set, root=root_rank)
    return _add(h, lambda _: output, tensor, output)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place `broadcast_async`: non-root ranks' tensors are overwritten."""
    h = enqueue(RequestType.BROADCAST, [tensor], outputs=[tensor], name=name,
                process_set=process_set, root=root_rank)
    return _add(h, lambda _: tensor, tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns `tensor`."""
    run_one(RequestType.BROADCAST, tensor, tensor, name, process_set, root=root_rank)
    return tensor


def _splits_array(splits: Any) -> np.ndarray | None:
    """`splits` as numpy values, unconverted: the runtime checks them (whole row counts only,
    never truncated) when the op is queued, with the tensor's name in the message."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu()
        if splits.dtype == torch.bfloat16:  # no numpy form
            splits = splits.to(torch.float32)
        return splits.numpy()
    return np.asarray(splits)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Starts sending `splits[r]` dim-0 slices to rank r (even split when None).

    `synchronize` returns `(output, received_splits)`.

    Raises:
        ValueError: bad splits (wrong length, negative, not whole row counts, more rows
            than the tensor has).
    """
    h = enqueue(RequestType.ALLTOALL, [tensor], name=name, process_set=process_set,
                splits=_splits_array(splits))

    like = splits if isinstance(splits, torch.Tensor) else None

    def finish(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = result
        return from_collective(out, tensor), _received_splits(received, like)
    return _add(h, finish, tensor)


def _received_splits(received: Any, like: torch.Tensor | None) -> torch.Tensor:
    """alltoall's received splits (int32) on the device of the `splits` tensor passed in, as
    Horovod returns them (on the CPU when splits was None or a list)."""
    if isinstance(received, torch.Tensor):
        out = received.to(torch.int32)
    else:
        out = torch.from_numpy(np.asarray(received, dtype=np.int32))
    if like is not None and out.device != like.device:
        out = out.to(like.device)
    return out



def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Starts reducing, then giving rank r its share of dim 0 (the first dim0 % size ranks get
    one row more).

    Raises:
        HorovodInternalError: op other than Sum or Average.
    """
    op = reducescatter_op(op)
    h = enqueue(RequestType.REDUCESCATTER, [tensor], name=name, process_set=process_set,
                op=op, prescale=prescale_factor, postscale=postscale_factor)
    return _add(h, lambda r: from_collective(r, tensor), tensor)


def grouped_reducescatter_async(tensors: Tensors, name: str | None = None,
                                op: ReduceOp = ReduceOp.AVERAGE,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """List form of `reducescatter_async`."""
    op = reducescatter_op(op)
    ts = list(tensors)
    h = enqueue(RequestType.REDUCESCATTER, ts, name=name, process_set=process_set, op=op,
                prescale=prescale_factor, postscale=postscale_factor, grouped=True)
    return _add(h, lambda rs: [from_collective(r, t) for r, t in zip(rs, ts)], ts)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Reduces a sparse COO tensor by allgathering its indices and values.

    Returns a function; calling it waits and returns the summed (coalesced) sparse tensor,
    divided by the set's size for Average.

    Raises:
        ValueError: `tensor` is not a sparse COO tensor, or `op` is not Sum/Average.
    """
    if tensor.layout != torch.sparse_coo:
        raise ValueError(f"sparse_allreduce_async needs a sparse COO tensor, got {tensor.layout}")
    op = ReduceOp(int(op))
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError("sparse_allreduce_async supports only Sum and Average")
    t = tensor
    # Allgather concatenates along dim 0, so indices travel transposed (nnz x ndim).
    indices = t._indices().transpose(0, 1).contiguous()
    values = t._values().contiguous()
    prefix = f"{name}." if name is not None else ""
    vh = allgather_async(values, name=f"{prefix}values" if name is not None else None,
                         process_set=process_set)
    ih = allgather_async(indices, name=f"{prefix}indices" if name is not None else None,
                         process_set=process_set)

    def result() -> torch.Tensor:
        try:
            vals = synchronize(vh)
        except BaseException:
            try:  # waited for too, so that no handle is left in the handle map
                synchronize(ih)
            except Exception:  # noqa: BLE001 - the values' error is the one to report
                pass
            raise
        idx = synchronize(ih)
        if op == ReduceOp.AVERAGE:
            vals = vals / process_set_size(process_set)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size(),
                                       check_invariants=False).coalesce()
    return result


# -- barrier / join / handles ---------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every member of the process set has called `barrier`."""
    collective.barrier(process_set=process_set)


def join(device: int = -1) -> int:
    if device < 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        # A rank that joins before its first GPU op contributes zeros on its own GPU.
        device = torch.cuda.current_device()
    return collective.join(device)


join.__doc__ = collective.join.__doc__  # one text, collective/ops.py's


def poll(handle: int) -> bool:
    """True when the op behind `handle` finished. Never blocks.

    Raises:
        ValueError: unknown (already synchronized) handle.
    """
    if isinstance(handle, Handle):
        return handle.done()
    return handles.poll(handle)


def wait_now(start: Callable[..., Any], *args: Any) -> Any:
    """`synchronize(start(*args))` for the synchronous functions (see `collective.adapter.wait_now`:
    no fusion-window wait, and the negotiation runs on this thread when it can)."""
    return _collective_wait_now(synchronize, start, *args)


def synchronize(handle: int) -> Any:
    """Waits for the op behind `handle` and returns its output (for alltoall the tuple
    `(output, received_splits)`; for grouped ops a list).

    Raises:
        ValueError: unknown handle (ringvod raises where Horovod returned None).
        HorovodInternalError: the op failed on this or another rank.
    """
    if isinstance(handle, Handle):
        return handle.wait()
    return handles.synchronize(handle)
