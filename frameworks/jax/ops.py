"""Collectives on JAX arrays: the functions of `horovod.jax` (ringvod's JAX API).

Every function takes JAX arrays on the host (CPU) — or anything `jnp.asarray` takes — and
returns new JAX arrays of the same dtype (bfloat16 included): JAX arrays are immutable, so there
are no in-place (`_`) forms. Signatures follow `horovod.torch`'s. The `_async` forms return a
`JaxHandle`; `synchronize(handle)` waits and returns the JAX result, `poll(handle)` never blocks.

The collectives run eagerly and cannot be called inside `jax.jit`, `jax.grad` or other
transformations (a traced value raises `TypeError`); arrays on a GPU or TPU raise
`NotImplementedError` naming the device. Calls before `init()`, mismatched shapes or dtypes
across ranks and other errors are the runtime's, as in the other adapters.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from collective import (ProcessSet, ReduceOp, RequestType,
                        global_process_set, resolve_op)
from collective.adapter import reducescatter_op, wait_now as _wait_now

from ._arrays import JaxHandle, enqueue, host_array, run_one, to_jax
from .compression import Compression, check_compressor

__all__ = [
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll",
]

_AR, _AG, _BC, _A2A, _RS = (RequestType.ALLREDUCE, RequestType.ALLGATHER, RequestType.BROADCAST,
                            RequestType.ALLTOALL, RequestType.REDUCESCATTER)


def _start(kind: RequestType, arrays: Sequence[Any], label: str, grouped: bool,
           compression: Any = Compression.none, **kwargs: Any) -> JaxHandle:
    """Compresses, queues and returns a handle whose result is decompressed JAX arrays (a
    list when `grouped`)."""
    pairs = [compression.compress(_array(x)) for x in arrays]
    h, dtypes = enqueue(kind, [c for c, _ in pairs], label, grouped=grouped, **kwargs)
    ctxs = [c for _, c in pairs]

    def finish(result: Any) -> Any:
        out = [compression.decompress(to_jax(r, dt), c)
               for r, dt, c in zip(result if grouped else [result], dtypes, ctxs)]
        return out if grouped else out[0]
    return JaxHandle(h, finish)


def _array(x: Any) -> Any:
    """`x` unchanged when it is a JAX array (the checks run in `_arrays.host_view`), else as
    `_arrays.host_array` makes it (so that a compressor sees a JAX array)."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    return host_array(x)


def _sync(start: Callable[..., JaxHandle], *args: Any) -> Any:
    """`synchronize(start(*args))` with the runtime's fast paths for a caller that waits at once
    (`collective.adapter.wait_now`)."""
    box: list[JaxHandle] = []

    def raw(*a: Any) -> Any:
        jh = start(*a)
        box.append(jh)
        return jh.handle
    return _wait_now(lambda _h: box[0].wait(), raw, *args)


# -- allreduce ----------------------------------------------------------------------------------
def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None,
                    compression: Any = Compression.none, op: ReduceOp | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Starts reducing `tensor` across the process set (default op: Average); returns a handle.

    Raises:
        ValueError: not initialised, unsupported dtype, duplicate pending name, both `op` and
            `average`; NotImplementedError: a GPU/TPU array, op=Adasum; TypeError: a traced
            value.
    """
    op = resolve_op(op, average)
    check_compressor(compression)
    return _start(_AR, [tensor], "allreduce", False, compression, name=name,
                  process_set=process_set, op=op, prescale=prescale_factor,
                  postscale=postscale_factor)


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Reduces `tensor` across the process set; returns a new array (same dtype and shape).

    `op`: hvd.Average (default), Sum, Min, Max or Product; `prescale_factor` multiplies each
    rank's input, `postscale_factor` the result. `compression=hvd.Compression.fp16` (or `.bf16`)
    sends floating arrays in that dtype and casts the result back.

    Raises:
        as `allreduce_async`; HorovodInternalError: the op failed on some rank (e.g. the ranks'
            shapes or dtypes differ).
    """
    op = resolve_op(op, average)
    check_compressor(compression)
    if compression is Compression.none:
        return run_one(_AR, _array(tensor), "allreduce", name, process_set, op,
                       prescale_factor, postscale_factor)
    return _sync(allreduce_async, tensor, None, name, compression, op, prescale_factor,
                 postscale_factor, process_set)


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None,
                            name: str | None = None, compression: Any = Compression.none,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Starts allreducing a list as one atomic group (negotiated and fused together); the
    handle's result is a list."""
    op = resolve_op(op, average)
    check_compressor(compression)
    return _start(_AR, list(tensors), "grouped_allreduce", True, compression, name=name,
                  process_set=process_set, op=op, prescale=prescale_factor,
                  postscale=postscale_factor)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[jax.Array]:
    """List form of `allreduce` (one atomic group); returns a list."""
    return _sync(grouped_allreduce_async, tensors, average, name, compression, op,
                 prescale_factor, postscale_factor, process_set)


# -- allgather ----------------------------------------------------------------------------------
def _check_gather(tensors: Sequence[Any], label: str) -> None:
    for t in tensors:
        if np.ndim(t) == 0:
            raise ValueError(f"{label} needs an array with at least one dimension (it "
                             "concatenates along dim 0); reshape a scalar to (1,)")


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Starts concatenating every rank's array along dim 0 (dim-0 sizes may differ)."""
    _check_gather([tensor], "allgather")
    return _start(_AG, [tensor], "allgather", False, name=name, process_set=process_set)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Every rank's array concatenated along dim 0, in rank order (dim-0 sizes may differ;
    the other dims and the dtype must agree)."""
    return _sync(allgather_async, tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> JaxHandle:
    tensors = list(tensors)
    _check_gather(tensors, "grouped_allgather")
    return _start(_AG, tensors, "grouped_allgather", True, name=name, process_set=process_set)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[jax.Array]:
    """List form of `allgather` (one atomic group)."""
    return _sync(grouped_allgather_async, tensors, name, process_set)


# -- broadcast ----------------------------------------------------------------------------------
def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Starts sending global rank `root_rank`'s array to every rank of the process set."""
    return _start(_BC, [tensor], "broadcast", False, name=name, process_set=process_set,
                  root=root_rank)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Rank `root_rank`'s array, on every rank (a global rank, member of the process set).

    Raises:
        ValueError: root not in the process set (plus the common errors).
    """
    return run_one(_BC, _array(tensor), "broadcast", name, process_set, root=root_rank)


# -- alltoall -----------------------------------------------------------------------------------
def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Starts an alltoall; the handle's result is `(output, received_splits)`."""
    sp = None if splits is None else np.asarray(splits)
    h, dtypes = enqueue(_A2A, [_array(tensor)], "alltoall", name=name, process_set=process_set,
                        splits=sp)

    def finish(res: Any) -> tuple[jax.Array, jax.Array]:
        out, received = res
        return to_jax(out, dtypes[0]), host_array(np.asarray(received, dtype=np.int32))
    return JaxHandle(h, finish)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends `splits[r]` dim-0 slices to rank r (an even split when None) and concatenates what
    arrives. Returns the output when `splits` is None, else `(output, received_splits)` (int32).

    Raises:
        ValueError: bad splits (wrong length, negative, not whole row counts, more rows than
            the array has).
    """
    out, received = _sync(alltoall_async, tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# -- reducescatter ------------------------------------------------------------------------------

def reducescatter_async(tensor: Any, name: str | None = None,
                        compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> JaxHandle:
    """Starts a reducescatter (see `reducescatter`)."""
    op = reducescatter_op(op)
    check_compressor(compression)
    return _start(_RS, [tensor], "reducescatter", False, compression, name=name,
                  process_set=process_set, op=op, prescale=prescale_factor,
                  postscale=postscale_factor)


def reducescatter(tensor: Any, name: str | None = None, compression: Any = Compression.none,
                  op: ReduceOp = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> jax.Array:
    """Reduces across the set (Average or Sum), then returns this rank's share of dim 0 (the
    first dim0 % size ranks get one row more).

    Raises:
        HorovodInternalError: an op other than Sum or Average.
    """
    return _sync(reducescatter_async, tensor, name, compression, op, process_set,
                 prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                compression: Any = Compression.none,
                                op: ReduceOp = ReduceOp.AVERAGE,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> JaxHandle:
    op = reducescatter_op(op)
    check_compressor(compression)
    return _start(_RS, list(tensors), "grouped_reducescatter", True, compression, name=name,
                  process_set=process_set, op=op, prescale=prescale_factor,
                  postscale=postscale_factor)


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[jax.Array]:
    """List form of `reducescatter` (one atomic group)."""
    return _sync(grouped_reducescatter_async, tensors, name, compression, op, process_set,
                 prescale_factor, postscale_factor)


# -- handles ------------------------------------------------------------------------------------
def poll(handle: JaxHandle) -> bool:
    """True when the op behind `handle` finished. Never blocks."""
    return handle.done()


def synchronize(handle: JaxHandle) -> Any:
    """Waits for the op behind `handle` and returns its JAX result (a list for grouped ops,
    `(output, received_splits)` for alltoall).

    Raises:
        HorovodInternalError: the op failed on this or another rank.
    """
    return handle.wait()
