"""Collectives on numpy arrays, and `enqueue`, the entry point framework adapters build on.

Every op has an `_async` form returning a `Handle`; the plain form waits. Names follow Horovod:
`<prefix>.<name>`, or `<prefix>.noname.<n>` without a name, `n` counted per process set (then the
members of a set must issue its unnamed ops in the same order). Two-rank example::

    # rank 0: x = np.array([1., 2.])      rank 1: x = np.array([3., 4.])
    hvd.allreduce(x, op=hvd.Sum)          # both ranks: array([4., 6.])
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from . import _current as _rt
from .engines.device import OnStream, ready_now
from .entry import Entry, default_allocate
from .errors import HorovodInternalError
from .handle import GroupHandle, Handle
from .process_sets import ProcessSet, global_process_set
from .types import CPU_DEVICE, DataType, ReduceOp, Request, RequestType, dtype_of
from .wire import MAX_STR_BYTES, quote_name

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "enqueue", "resolve_op",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
    "synchronize", "wait_now", "run_one",
]

Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT
_BOOL = DataType.BOOL

# An async device allreduce this large, started by a user's call (`enqueue(eager=True)`), is
# negotiated and launched on the caller's thread (`_start_now`).
EAGER_BYTES = 64 << 20

_PREFIX = {RequestType.ALLREDUCE: "allreduce", RequestType.ALLGATHER: "allgather",
           RequestType.BROADCAST: "broadcast", RequestType.ALLTOALL: "alltoall",
           RequestType.REDUCESCATTER: "reducescatter"}
_LABEL = {RequestType.ALLREDUCE: "Allreduce", RequestType.ALLGATHER: "Allgather",
          RequestType.BROADCAST: "Broadcast", RequestType.ALLTOALL: "Alltoall",
          RequestType.REDUCESCATTER: "Reducescatter", RequestType.BARRIER: "Barrier",
          RequestType.JOIN: "Join"}


def resolve_op(op: Any, average: bool | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Horovod's op/average rules: `average` is deprecated and conflicts with `op`.

    Raises:
        ValueError: both given.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return default
    return op if type(op) is ReduceOp else ReduceOp(int(op))


def _check_reduce(dtype: DataType, op: ReduceOp, label: str) -> None:
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by ringvod; use op=hvd.Average or "
                                  "hvd.Sum")
    if dtype == _BOOL and op == Average:
        raise ValueError(f"{label}: Average of a bool tensor is undefined; use Sum (logical or), "
                         "Min or Max.")


def enqueue(kind: RequestType, tensors: Sequence[Any], *, name: str | None = None,
            process_set: ProcessSet = global_process_set, op: ReduceOp = ReduceOp.SUM,
            prescale: float = 1.0, postscale: float = 1.0, root: int = -1,
            outputs: Sequence[Any] | None = None, splits: Any = None,
            dtypes: Sequence[DataType] | None = None, shapes: Sequence[tuple] | None = None,
            device: int = CPU_DEVICE, ready_events: Sequence[Any] | None = None,
            allocate: Callable[[tuple, Any], Any] | None = None, grouped: bool = False,
            contexts: Sequence[dict] | None = None, layout: int = 0,
            eager: bool = False) -> Handle:
    """Queues one op (or a grouped op) and returns its handle. For adapters and the numpy API.

    Host tensors are numpy arrays (dtype and shape read from them); device tensors are opaque
    objects for the device engine, with `dtypes`/`shapes` given explicitly. `layout`: for a
    tensor packed from smaller ones, a digest of their shapes (an unsigned 64-bit int): ranks
    that send different digests under one name get a `MismatchError`, as for shapes.
    `eager`: the op comes from a user's async call (not a gradient hook): a single device
    allreduce of `EAGER_BYTES` or more is then negotiated and launched before this returns
    (`_start_now`).

    Raises:
        ValueError: not initialised, bad process set or root, bad splits, duplicate name,
            name over 1 MiB (`wire.MAX_STR_BYTES`).
        ShutdownError: the runtime has shut down.
    """
    rt = _rt.current()
    state = rt.process_set_state(process_set, _LABEL[kind])
    hid, base, prefix = _names(rt, state, kind, name, process_set, root)
    prescale, postscale = float(prescale), float(postscale)
    if grouped:
        prefix = "grouped_" + prefix
        n = len(tensors)
        entries = [
            _entry(state, kind, f"{prefix}.{base}_{i + 1}of{n}", t,
                   dtypes[i] if dtypes is not None else None,
                   shapes[i] if shapes is not None else None, device, root, op, prescale,
                   postscale, hid, outputs[i] if outputs is not None else None, allocate,
                   ready_events[i] if ready_events is not None else None, splits,
                   contexts[i] if contexts is not None else None)
            for i, t in enumerate(tensors)]
    else:
        if len(tensors) != 1:
            raise ValueError(f"{_LABEL[kind]} takes one tensor (got {len(tensors)}); use the "
                             "grouped_ form for a list")
        entries = [_entry(state, kind, f"{prefix}.{base}", tensors[0],
                          dtypes[0] if dtypes is not None else None,
                          shapes[0] if shapes is not None else None, device, root, op, prescale,
                          postscale, -1, outputs[0] if outputs is not None else None, allocate,
                          ready_events[0] if ready_events is not None else None, splits,
                          contexts[0] if contexts is not None else None)]
    if layout:
        for e in entries:
            e.request.layout = layout
    caller = _waiting_caller
    if caller.coord is None:
        if eager and device != CPU_DEVICE and not grouped and _eager(entries[0].request):
            _start_now(rt, state, entries[0])
        else:
            rt.submit(state, entries)
    else:  # the first op of a synchronous function (`wait_now`), which waits for it at once
        coord, caller.coord = caller.coord, None
        if not grouped and coord.express(state, entries[0]):
            caller.did = "ran"
        else:
            rt.submit(state, entries, wake=False)  # wait_now runs the cycle (drive)
            caller.did = "queued"
    if grouped:
        return GroupHandle(f"{prefix}.{base}", [e.handle for e in entries])
    return entries[0].handle


def run_one(kind: RequestType, tensor: Any, output: Any, name: str | None,
            process_set: ProcessSet, op: ReduceOp, prescale: float, postscale: float,
            root: int = -1, dtype: DataType | None = None, shape: tuple | None = None,
            device: int = CPU_DEVICE, ready_event: Any = None,
            allocate: Callable[[tuple, Any], Any] | None = None) -> Any:
    """One single-tensor op of a synchronous function, run and waited for: what
    `wait_now(synchronize, <its _async function>, ...)` does, minus the layers in between
    (they made a lone `hvd.allreduce_` about 1.5× slower; `tools/lone_loop.py`). Arguments
    as `enqueue`'s for one tensor (`output` None = allocate); returns the
    handle's result.

    Raises:
        as `enqueue`; HorovodInternalError: the op failed on this or another rank.
    """
    rt = _rt.current()
    state = rt.process_set_state(process_set, _LABEL[kind])
    _hid, base, prefix = _names(rt, state, kind, name, process_set, root)
    e = _entry(state, kind, f"{prefix}.{base}", tensor, dtype, shape, device, root, op,
               float(prescale), float(postscale), -1, output, allocate, ready_event, None, None)
    coord = rt.coordinator
    h = e.handle
    if coord.express(state, e):
        return h.wait()
    if type(ready_event) is OnStream:  # the op leaves this thread's stream order
        ready_now(e)
    rt.submit(state, [e], wake=False)
    coord.drive()
    return _wait_blocking(coord, h, Handle.wait)


def _eager(req: Request) -> bool:
    return (req.type is _ALLREDUCE and EAGER_BYTES > 0
            and req.num_elements() * req.dtype.itemsize >= EAGER_BYTES)


def _start_now(rt: Any, state: Any, e: Entry) -> None:
    """Negotiates and launches a large async device allreduce on the caller's thread, as a
    synchronous op would (the express lane, else a driven cycle), without waiting for its
    result. Handed to the coordinator thread instead, the op would reach the GPU only when the
    caller lets go of the GIL (its next wait, or the interpreter's switch interval): a program
    that starts many large ops and then waits for them would leave the GPU idle for its whole
    submit loop. A cycle's host time is hidden behind the GPU time of an op this large, not
    behind a smaller one's (benchmarks/RESULTS.md). The call returns once the other ranks
    have taken part in the round: when they submitted the op too, or at their next round
    (the op then waits as any other). While ops of this rank are still waiting (a peer is
    behind), the op goes to the coordinator thread instead, so that a loop of such calls
    waits for a late peer's round once, not once per call."""
    coord = rt.coordinator
    if coord.express(state, e):
        return
    waiting = state.pending()  # a dict read, no lock: a stale answer only picks the other path
    rt.submit(state, [e], wake=waiting)
    if not waiting:
        coord.drive()


def _names(rt: Any, state: Any, kind: RequestType, name: str | None, process_set: ProcessSet,
           root: int) -> tuple[int, str, str]:
    """(handle id, name without prefix, prefix) of a new op; checks a broadcast's root.

    An unnamed op is `noname.<n>` with `n` counted per process set (`state.next_noname`),
    not Horovod's process-wide handle number: only a set's members issue its ops, so with one
    process-wide counter an unnamed op on a subset shifts the numbers of the members' later
    unnamed ops against the other ranks' (a hang, or two different ops reduced together).
    Where every rank issues the same ops in the same order the names still match.

    Raises:
        ValueError: the root is not a member of the process set.
    """
    hid = rt.next_handle_id()
    if kind == _BROADCAST:
        members = rt.ranks_of(process_set)
        if root not in members:
            raise ValueError(f"broadcast received invalid root rank {root} for provided process "
                             f"set (members: {members})")
    return (hid, name if name is not None else f"noname.{state.next_noname()}",
            _PREFIX.get(kind) or kind.name.lower())


# A name of at most this many characters fits the wire's limit whatever they are (UTF-8 takes at
# most 4 bytes a character): only longer ones are encoded to be measured.
_NAME_CHARS_OK = MAX_STR_BYTES // 4


def _check_name(name: str, label: str) -> None:
    """Raises:
        ValueError: the name is longer than the control plane carries (`MAX_STR_BYTES`).
    """
    n = len(name.encode("utf-8", "surrogatepass"))
    if n > MAX_STR_BYTES:
        raise ValueError(f"{label}: the name of tensor {quote_name(name)} is too long: names "
                         f"are limited to {MAX_STR_BYTES} bytes (1 MiB, UTF-8), op prefix "
                         "included. Give the tensor a shorter name.")


_ALLREDUCE, _REDUCESCATTER, _BROADCAST, _ALLTOALL = (
    RequestType.ALLREDUCE, RequestType.REDUCESCATTER, RequestType.BROADCAST, RequestType.ALLTOALL)


def _entry(state: Any, kind: RequestType, name: str, tensor: Any, dtype: DataType | None,
           shape: tuple | None, device: int, root: int, op: ReduceOp, prescale: float,
           postscale: float, group_id: int, output: Any, allocate: Any, ready_event: Any,
           splits: Any, context: dict | None) -> Entry:
    """One table entry (positional arguments: this runs for every op)."""
    if len(name) > _NAME_CHARS_OK:
        _check_name(name, _LABEL[kind])
    if dtype is None:
        dtype = dtype_of(tensor)
    shape = tuple(tensor.shape) if shape is None else tuple(shape)
    if kind == _ALLREDUCE or kind == _REDUCESCATTER:
        _check_reduce(dtype, op, _LABEL[kind])
    req = Request(state.rank, kind, name, dtype, shape, device, root, op, prescale, postscale,
                  group_id)
    e = Entry(req, tensor, Handle(name), output, allocate or default_allocate, None, None,
              ready_event, None, {} if context is None else context)
    if kind == _ALLTOALL:
        e.result_kind = "alltoall"
        e.splits = _alltoall_splits(splits, shape, state.size, name, state.ranks[state.rank])
    return e


def splits_values(splits: Any, name: str | None, rank: int) -> np.ndarray:
    """alltoall's `splits` (a list, array or tensor's values) as a 1-D integer array: the one
    rule for every entry point. Integers are taken as given; floats only when every value is
    a whole number (2.0, as `n / size` gives); nothing is rounded or truncated. `name`: the
    op's tensor name (None: unnamed); `rank`: this process's rank, for the message.

    Raises:
        ValueError: not 1-D, or a value that is not a whole row count (1.5, nan, a bool, a
            string), naming the tensor, the rank and what was given.
    """
    arr = np.asarray(splits)
    if arr.ndim != 1:
        raise ValueError("alltoall expects a 1D splits tensor")
    kind = arr.dtype.kind
    if kind in "iu":
        return arr
    if kind == "f":
        f = arr.astype(np.float64)
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(f) & (np.abs(f) < 2.0 ** 31) & (np.mod(f, 1) == 0)
        if whole.all():
            return f.astype(np.int64)
    shown = np.array2string(arr, separator=", ", threshold=16)
    tensor = "an unnamed tensor" if name is None else f"tensor {quote_name(name)}"
    raise ValueError(
        f"alltoall expects splits to contain 32-bit integer elements: rank {rank} gave "
        f"splits={shown} ({arr.dtype}) for {tensor}, which are not whole row counts (they "
        "are never rounded or truncated). Give integers, e.g. a list of ints or an int32 "
        "tensor; floats are accepted only when every value is whole, such as 2.0.")


def _alltoall_splits(splits: Any, shape: tuple, size: int, name: str, rank: int) -> np.ndarray:
    dim0 = shape[0] if shape else 0
    if splits is None:
        if dim0 % size:
            raise ValueError("splits not provided, but first dimension of tensor is not an even "
                             "multiple of the number of workers.")
        return np.full(size, dim0 // size, dtype=np.int32)
    arr = splits_values(splits, name, rank)
    if arr.size != size:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    if (arr < 0).any():
        raise ValueError("alltoall splits must be non-negative")
    if sum(int(v) for v in arr) > dim0:  # Python ints: no overflow, whatever the dtype
        raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    return arr.astype(np.int32)


def _contiguous(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    # np.ascontiguousarray turns a 0-d array into shape (1,); keep scalars scalar.
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _require_contiguous(a: np.ndarray, written: bool = True) -> np.ndarray:
    """The tensor of an in-place op; `written`: this rank's result is written into it (not so
    for a broadcast's root).

    Raises:
        ValueError: not a C-contiguous numpy array, or read-only where written (checked here:
            the engine's write would fail on the coordinator and abort the job on every rank).
    """
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        raise ValueError("Tensor is required to be contiguous.")
    if written and not a.flags.writeable:
        raise ValueError("Tensor is read-only: an in-place op writes its result into it. Use "
                         "the out-of-place form (e.g. allreduce instead of allreduce_) or pass "
                         "a writeable array.")
    return a


# -- allreduce ---------------------------------------------------------------------------------
def allreduce_async(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Reduces `tensor` across the process set into a new array; returns a handle.

    Raises:
        ValueError: not initialised, unsupported dtype, duplicate name, op/average conflict.
    """
    op = resolve_op(op, average)
    return enqueue(RequestType.ALLREDUCE, [_contiguous(tensor)], name=name,
                   process_set=process_set, op=op, prescale=prescale_factor,
                   postscale=postscale_factor)


def allreduce(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Synchronous `allreduce_async`; returns the reduced array (input unchanged)."""
    return run_one(RequestType.ALLREDUCE, _contiguous(tensor), None, name, process_set,
                   resolve_op(op, average), prescale_factor, postscale_factor)


def allreduce_async_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place allreduce: the result overwrites `tensor` (which must be contiguous)."""
    op = resolve_op(op, average)
    t = _require_contiguous(tensor)
    return enqueue(RequestType.ALLREDUCE, [t], name=name, process_set=process_set, op=op,
                   prescale=prescale_factor, postscale=postscale_factor, outputs=[t])


def allreduce_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    op = resolve_op(op, average)
    t = _require_contiguous(tensor)
    return run_one(RequestType.ALLREDUCE, t, t, name, process_set, op, prescale_factor,
                   postscale_factor)


def grouped_allreduce_async(tensors: Sequence[np.ndarray], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Allreduces a list atomically (members negotiate and fuse together)."""
    op = resolve_op(op, average)
    return enqueue(RequestType.ALLREDUCE, [_contiguous(t) for t in tensors], name=name,
                   process_set=process_set, op=op, prescale=prescale_factor,
                   postscale=postscale_factor, grouped=True)


def grouped_allreduce(tensors: Sequence[np.ndarray], average: bool | None = None,
                      name: str | None = None, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return wait_now(synchronize, grouped_allreduce_async, tensors, average, name, op,
                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    op = resolve_op(op, average)
    ts = [_require_contiguous(t) for t in tensors]
    return enqueue(RequestType.ALLREDUCE, ts, name=name, process_set=process_set, op=op,
                   prescale=prescale_factor, postscale=postscale_factor, outputs=ts,
                   grouped=True)


def grouped_allreduce_(tensors: Sequence[np.ndarray], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return wait_now(synchronize, grouped_allreduce_async_, tensors, average, name, op,
                    prescale_factor, postscale_factor, process_set)


# -- allgather / broadcast / alltoall / reducescatter -------------------------------------------
def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Concatenates every rank's tensor along dim 0 (dim-0 sizes may differ)."""
    return enqueue(RequestType.ALLGATHER, [_contiguous(tensor)], name=name,
                   process_set=process_set)


def allgather(tensor: np.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return wait_now(synchronize, allgather_async, tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[np.ndarray], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    return enqueue(RequestType.ALLGATHER, [_contiguous(t) for t in tensors], name=name,
                   process_set=process_set, grouped=True)


def grouped_allgather(tensors: Sequence[np.ndarray], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return wait_now(synchronize, grouped_allgather_async, tensors, name, process_set)


def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Returns a copy of the root's tensor on every rank (`root_rank` is a global rank)."""
    return enqueue(RequestType.BROADCAST, [_contiguous(tensor)], name=name,
                   process_set=process_set, root=root_rank)


def broadcast(tensor: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return run_one(RequestType.BROADCAST, _contiguous(tensor), None, name, process_set,
                   Sum, 1.0, 1.0, root_rank)


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    t = _require_contiguous(tensor, written=_rt.current().rank != root_rank)
    return enqueue(RequestType.BROADCAST, [t], name=name, process_set=process_set,
                   root=root_rank, outputs=[t])


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    t = _require_contiguous(tensor, written=_rt.current().rank != root_rank)
    return run_one(RequestType.BROADCAST, t, t, name, process_set, Sum, 1.0, 1.0, root_rank)


def alltoall_async(tensor: np.ndarray, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Sends `splits[r]` rows to rank r; the handle yields (output, received_splits)."""
    return enqueue(RequestType.ALLTOALL, [_contiguous(tensor)], name=name,
                   process_set=process_set, splits=splits)


def alltoall(tensor: np.ndarray, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Returns the output, or (output, received_splits) when `splits` is given."""
    out, recv = wait_now(synchronize, alltoall_async, tensor, splits, name, process_set)
    return out if splits is None else (out, recv)


def reducescatter_op(op: Any) -> ReduceOp:
    """`op` as a `ReduceOp`, checked for reducescatter (every adapter's, with Horovod's error).

    Raises:
        HorovodInternalError: an op other than Sum or Average.
    """
    op = ReduceOp(int(op))
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    return op


def reducescatter_async(tensor: np.ndarray, name: str | None = None,
                        op: ReduceOp = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Reduces, then gives rank r its share of dim 0 (the first dim0 % size ranks get one more)."""
    return enqueue(RequestType.REDUCESCATTER, [_contiguous(tensor)], name=name,
                   process_set=process_set, op=reducescatter_op(op), prescale=prescale_factor,
                   postscale=postscale_factor)


def reducescatter(tensor: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.AVERAGE,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    return wait_now(synchronize, reducescatter_async, tensor, name, op, process_set,
                    prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors: Sequence[np.ndarray], name: str | None = None,
                                op: ReduceOp = ReduceOp.AVERAGE,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    return enqueue(RequestType.REDUCESCATTER, [_contiguous(t) for t in tensors], name=name,
                   process_set=process_set, op=reducescatter_op(op), prescale=prescale_factor,
                   postscale=postscale_factor, grouped=True)


def grouped_reducescatter(tensors: Sequence[np.ndarray], name: str | None = None,
                          op: ReduceOp = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    return wait_now(synchronize, grouped_reducescatter_async, tensors, name, op, process_set,
                    prescale_factor, postscale_factor)


# -- barrier / join / handles -------------------------------------------------------------------
def _control_op(kind: RequestType, name: str, process_set: ProcessSet,
                device: int = CPU_DEVICE) -> Handle:
    rt = _rt.current()
    state = rt.process_set_state(process_set, _LABEL[kind])
    e = Entry(Request(rank=state.rank, type=kind, name=name, device=device), None, Handle(name),
              result_kind="join" if kind == RequestType.JOIN else None)
    rt.submit(state, [e])
    return e.handle


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every member of the process set has called `barrier`."""
    synchronize(_control_op(RequestType.BARRIER, "barrier.noname", process_set))


def join(device: int = -1) -> int:
    """Signals that this rank has no more data; joined ranks contribute zeros to allreduces.

    Blocks until every rank has joined and returns the last rank to join (same on all ranks).

    Join covers the global process set only (Horovod's join takes no process set): a joined
    rank contributes zeros to global allreduces and takes no part in ops of other process
    sets. An op of another set that waits for a joined rank fails on the ranks that submitted
    it (HorovodInternalError naming the tensor, the set and the joined ranks; the joined rank
    logs it) instead of waiting for it. Finish the ops of other process sets before calling
    `join`.

    `device`: the GPU whose zeros this rank contributes to device ops while it is joined (as
    Horovod's; -1: the current device of the thread that runs them, which the torch adapter
    replaces with the caller's current CUDA device once CUDA is in use).
    """
    return synchronize(_control_op(RequestType.JOIN, "join.noname", global_process_set,
                                   device))


def poll(handle: Handle) -> bool:
    """True when the op behind `handle` has finished. Never blocks."""
    return handle.done()


# What the first `enqueue` inside `wait_now` did: "ran" (the express lane ran it), "queued"
# (submitted without waking the coordinator thread: wait_now drives the cycle) or None.
class _Caller(threading.local):
    coord: Any = None  # class defaults: getattr on an unset thread-local raises inside
    did: str | None = None


_waiting_caller = _Caller()


def wait_now(sync: Callable[[Any], Any], start: Callable[..., Any], *args: Any) -> Any:
    """`sync(start(*args))` for a synchronous function: the thread that will block on the op
    runs the work itself instead of handing it to the coordinator thread and waiting to be
    woken (two thread hand-offs, most of a lone op's latency):

    * a lone cached op (nothing else in flight on this rank) is negotiated and run right inside
      its `enqueue` (`Coordinator.express`);
    * otherwise the op is queued without waking the coordinator thread and this thread runs
      the negotiation cycle (`Coordinator.drive`) when no cycle is running. While it then
      blocks on a device op, the coordinator negotiates device requests at once instead of
      collecting them for its fusion window (`Coordinator.waiting`).
    """
    coord = getattr(_rt.current_or_none(), "coordinator", None)
    if coord is None:
        return sync(start(*args))
    caller = _waiting_caller
    outer = caller.coord, caller.did  # a wait_now around us
    caller.coord, caller.did = coord, None
    try:
        h = start(*args)
    except BaseException:
        if caller.did == "queued":  # queued before failing: the coordinator thread runs it
            coord.wake()
        raise
    finally:
        did = caller.did
        caller.coord, caller.did = outer
    if did == "ran":
        return sync(h)
    if did == "queued":
        coord.drive()
    return _wait_blocking(coord, h, sync)


def _wait_blocking(coord: Any, h: Any, sync: Callable[[Any], Any]) -> Any:
    """`sync(h)`; while it blocks, the coordinator knows someone waits (`Coordinator.waiting`:
    device requests are then negotiated at once, not collected for a fusion window)."""
    if isinstance(h, Handle) and h.done():
        return sync(h)
    coord.waiting(1)
    try:
        return sync(h)
    finally:
        coord.waiting(-1)


def synchronize(handle: Handle) -> Any:
    """Waits for the op and returns its result.

    Raises:
        HorovodInternalError: the op failed on this or another rank (mismatch, dead peer,
            shutdown).
    """
    return handle.wait()
