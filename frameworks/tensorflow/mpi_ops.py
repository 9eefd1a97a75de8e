"""The collectives of `horovod.tensorflow` on eager tensors and inside `tf.function`.

How each op runs:

* eagerly, the op is handed to the engines at once: host tensors as NumPy views of their own
  buffer, results wrapped back through DLPack (no copy either way; see `_buffers`), and the
  calling thread waits for the result;
* inside a `tf.function` (graph mode), the same eager code runs as one `tf.py_function` per
  collective call, with the output's static shape set (allreduce and broadcast keep the input's
  shape; allgather and alltoall leave dim 0 unknown; reducescatter computes its share when dim
  0 is known). `tf.function` orders stateful ops, `py_function` included, in program order, so
  every rank issues its collectives in the same order;
* gradients are registered with `tf.custom_gradient`, as Horovod defines them: allreduce ->
  allreduce with the same op and factors; allgather -> Average allreduce, then this rank's rows;
  broadcast -> Average allreduce, zero on non-root ranks; alltoall -> alltoall with the
  received splits; reducescatter -> allgather, times the set's size for Sum, times the factors.
  Backward ops are named `<name>.grad` when the forward op has a name.

Names: `name` keys an op across ranks (prefixed with the current name scope unless
`ignore_name_scope=True`); without one the ranks' ops are matched by their order.
`device_dense` / `device_sparse` have no effect (ops run on the tensor's own device) and warn.

As Horovod's module, it also has the basics (`init`, `shutdown`, `rank`, `size`, ..., the
`*_built`/`*_enabled` queries, the timeline and process set functions): the same objects as
`horovod.tensorflow`'s.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

import collective
from collective import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                        ReduceOp, RequestType, Sum, global_process_set, resolve_op)
# The basics Horovod's `horovod.tensorflow.mpi_ops` defines too (re-exports, as torch's mpi_ops).
from collective import (add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                        ddl_built, gloo_built, gloo_enabled, is_homogeneous, is_initialized,
                        local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                        nccl_built, rank, remove_process_set, rocm_built, size, start_timeline,
                        stop_timeline)

from .._common import not_registered, process_set_rank, process_set_size
from .basics import init, shutdown
from ._buffers import dtype_of, eager, enqueue, finish, run_one
from collective.adapter import (config, process_set_by_id, reducescatter_op, splits_values,
                                wait_now)
from .compression import Compression, check_compressor

__all__ = [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "rank_op",
    "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "process_set_size", "process_set_rank", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "init", "shutdown", "is_initialized", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
]

try:  # whether a GradientTape could record this op (skip custom_gradient's cost otherwise)
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:  # pragma: no cover - older/newer TF layouts
    def _could_record() -> bool:
        return True

try:
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _xla_ctx
except ImportError:  # pragma: no cover
    _xla_ctx = None

_warned: set[str] = set()


def _in_xla() -> bool:
    if _xla_ctx is None:
        return False
    return bool(_xla_ctx(tf.compat.v1.get_default_graph()))


def _no_effect(**options: Any) -> None:
    for key, value in options.items():
        if value and key not in _warned:
            _warned.add(key)
            warnings.warn(f"{key}={value!r} has no effect in ringvod: collectives run on the "
                          "device the tensor is on", stacklevel=3)


def _name(name: str | None, ignore_name_scope: bool) -> str | None:
    if name is None:
        return None
    if not ignore_name_scope:
        scope = tf.get_current_name_scope()
        if scope:
            return f"{scope}/{name}"
    return str(name)


def _grad_name(name: str | None, suffix: str = "grad") -> str | None:
    return None if name is None else f"{name}.{suffix}"




# -- graph-side basics ----------------------------------------------------------------------------
def _now_op(read: Callable[[], int], name: str | None) -> tf.Tensor:
    """`read()` as an int32 tensor: a constant eagerly, and inside a `tf.function` too unless
    the job is elastic, where rank and sizes may change after tracing (read when it runs)."""
    if tf.executing_eagerly() or not may_resize():
        return tf.constant(read(), dtype=tf.int32, name=name)
    value = tf.py_function(lambda: np.int32(read()), [], tf.int32)
    value.set_shape([])
    return tf.identity(value, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This rank as an int32 tensor (Horovod's graph op; in an elastic job, read when a
    `tf.function` runs, since a reset may renumber the ranks)."""
    return _now_op(lambda: collective.rank(), name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return _now_op(lambda: collective.local_rank(), name)


def _set_of(process_set_id: int, process_set: ProcessSet | None) -> ProcessSet:
    """`process_set`, else the registered set with id `process_set_id` (Horovod's form)."""
    if process_set is not None:
        return process_set
    if process_set_id == 0:
        return global_process_set
    return process_set_by_id(process_set_id)


def size_op(process_set_id: int = 0, name: str | None = None,
            process_set: ProcessSet | None = None) -> tf.Tensor:
    """The process set's size as an int32 tensor; inside a `tf.function`, read each time the
    function runs (as Horovod's op), so that a compiled step sees an elastic job's resize."""
    ps = _set_of(process_set_id, process_set)
    if tf.executing_eagerly():
        return tf.constant(process_set_size(ps), dtype=tf.int32, name=name)
    return tf.identity(_size_now(ps), name=name)


def _size_now(ps: ProcessSet) -> Any:
    """The process set's size: a Python int eagerly; inside a `tf.function`, an int32 tensor
    read when the function runs."""
    if tf.executing_eagerly():
        return process_set_size(ps)
    size = tf.py_function(lambda: np.int32(process_set_size(ps)), [], tf.int32)
    size.set_shape([])
    return size


def may_resize() -> bool:
    """Whether the world size may change after a `tf.function` was traced (an elastic job):
    a compiled step must then not leave out a collective because the set had one rank when it
    was traced."""
    if not collective.is_initialized():
        return False
    return bool(config().elastic)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return _now_op(lambda: collective.local_size(), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None,
                            process_set: ProcessSet | None = None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0 (int32); always 1 for the global
    set, as Horovod's op.

    Raises:
        ValueError: the set is not registered.
    """
    ps = _set_of(process_set_id, process_set)
    if ps is global_process_set or ps.process_set_id == 0:
        return tf.constant(1, dtype=tf.int32, name=name)
    if ps.process_set_id is None:
        raise not_registered(ps)
    return tf.constant(int(bool(ps.included())), dtype=tf.int32, name=name)


# -- the kernels: eager tensors in, eager tensors out ---------------------------------------------
def _wait(handle: Any) -> Any:
    return handle.wait()


def _k_allreduce(ts: list[tf.Tensor], name: str | None, op: ReduceOp, pre: float, post: float,
                 ps: ProcessSet, grouped: bool) -> list[tf.Tensor]:
    if not grouped:
        return [run_one(RequestType.ALLREDUCE, ts[0], name, ps, op, pre, post)]
    res = wait_now(_wait, lambda: enqueue(RequestType.ALLREDUCE, ts, grouped=True, name=name,
                                          process_set=ps, op=op, prescale=pre, postscale=post))
    return [finish(r, t) for r, t in zip(res, ts)]


def _k_allgather(ts: list[tf.Tensor], name: str | None, ps: ProcessSet,
                 grouped: bool) -> list[tf.Tensor]:
    res = wait_now(_wait, lambda: enqueue(RequestType.ALLGATHER, ts, grouped=grouped, name=name,
                                          process_set=ps))
    if not grouped:
        res = [res]
    return [finish(r, t) for r, t in zip(res, ts)]


def _k_broadcast(ts: list[tf.Tensor], root: int, name: str | None,
                 ps: ProcessSet) -> list[tf.Tensor]:
    if len(ts) == 1:
        return [run_one(RequestType.BROADCAST, ts[0], name, ps, root=root)]
    handles = [enqueue(RequestType.BROADCAST, [t], name=None if name is None else f"{name}.{i}",
                       process_set=ps, root=root) for i, t in enumerate(ts)]
    return [finish(h.wait(), t) for h, t in zip(handles, ts)]


def _k_alltoall(t: tf.Tensor, splits: tf.Tensor | None, name: str | None,
                ps: ProcessSet) -> list[tf.Tensor]:
    sp = None if splits is None else splits._numpy()  # checked (never truncated) by enqueue
    res = wait_now(_wait, lambda: enqueue(RequestType.ALLTOALL, [t], name=name, process_set=ps,
                                          splits=sp))
    out, received = res
    if isinstance(out, tf.Tensor):
        return [out, tf.convert_to_tensor(received, dtype=tf.int32)]
    return [finish(out, t), tf.constant(np.asarray(received, dtype=np.int32))]


def _k_reducescatter(ts: list[tf.Tensor], name: str | None, op: ReduceOp, pre: float,
                     post: float, ps: ProcessSet, grouped: bool) -> list[tf.Tensor]:
    res = wait_now(_wait, lambda: enqueue(RequestType.REDUCESCATTER, ts, grouped=grouped,
                                          name=name, process_set=ps, op=op, prescale=pre,
                                          postscale=post))
    if not grouped:
        res = [res]
    return [finish(r, t) for r, t in zip(res, ts)]


def _run(kernel: Callable[[list[tf.Tensor]], list[tf.Tensor]], inputs: Sequence[tf.Tensor],
         touts: Sequence[tf.DType], shapes: Sequence[Any]) -> list[tf.Tensor]:
    """Runs `kernel` now (eager) or as one `tf.py_function` (graph), setting static shapes."""
    if tf.executing_eagerly():
        return kernel(list(inputs))
    if _in_xla():
        raise ValueError("ringvod collectives cannot run inside an XLA-compiled function "
                         "(jit_compile=True); compile with jit_compile=False (Keras: "
                         "model.compile(..., jit_compile=False))")
    outs = tf.py_function(lambda *xs: kernel(list(xs)), list(inputs), list(touts))
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    return list(outs)


def _differentiable(forward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    backward: Callable[[list[Any]], list[tf.Tensor]],
                    xs: list[tf.Tensor]) -> list[tf.Tensor]:
    """`forward(xs)` with `backward(dys)` as its gradient (skipped when no tape records)."""
    if tf.executing_eagerly() and not _could_record():
        return forward(xs)

    @tf.custom_gradient
    def fn(*args: tf.Tensor) -> Any:
        outs = forward(list(args))

        def grad(*dys: Any) -> Any:
            # An output used through an index (tf.gather, an embedding lookup) sends its
            # gradient back as IndexedSlices: the collectives take it dense, as Horovod's do.
            dys = [tf.zeros_like(o) if d is None else
                   tf.convert_to_tensor(d) if isinstance(d, tf.IndexedSlices) else d
                   for d, o in zip(dys, outs)]
            dxs = backward(dys)
            return dxs if len(dxs) > 1 else dxs[0]
        return tuple(outs), grad
    return list(fn(*xs))


def _check(ts: Sequence[tf.Tensor]) -> None:
    for t in ts:
        dtype_of(t.dtype)


def _float_grad(x: tf.Tensor) -> bool:
    return x.dtype.is_floating


# -- allreduce --------------------------------------------------------------------------------------
def _allreduce_list(ts: list[tf.Tensor], name: str | None, op: ReduceOp, pre: float,
                    post: float, ps: ProcessSet, grouped: bool) -> list[tf.Tensor]:
    _check(ts)
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("Adasum is not supported by ringvod; use op=hvd.Average or "
                                  "hvd.Sum")

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return _run(lambda e: _k_allreduce(e, name, op, pre, post, ps, grouped), xs,
                    [x.dtype for x in xs], [x.shape for x in xs])

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        return _allreduce_list(dys, _grad_name(name), op, pre, post, ps, grouped)
    return _differentiable(forward, backward, ts)


def _sparse_allreduce(slices: tf.IndexedSlices, name: str | None, op: ReduceOp, pre: float,
                      post: float, ps: ProcessSet) -> tf.IndexedSlices:
    """Horovod's `tf.IndexedSlices` allreduce: values and indices are allgathered. Checked
    before anything is sent, so that every rank raises alike."""
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("The Adasum reduction does not support sparse tensors; pass "
                                  "sparse_as_dense=True")
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError(f"tf.IndexedSlices support only op=Sum or Average, got {op!r}; "
                                  "pass sparse_as_dense=True")
    if pre != 1.0 or post != 1.0:
        what = f"tensor {name!r}, " if name else ""
        raise NotImplementedError(
            f"Pre/postscale_factor are not supported with tf.IndexedSlices ({what}"
            f"prescale_factor={pre}, postscale_factor={post}); scale the values yourself, or "
            "pass a dense tensor (tf.convert_to_tensor)")
    values = allgather(slices.values, name=_grad_name(name, "values"), process_set=ps,
                       ignore_name_scope=True)
    indices = allgather(slices.indices, name=_grad_name(name, "indices"), process_set=ps,
                        ignore_name_scope=True)
    if op == ReduceOp.AVERAGE:
        values = values / tf.cast(_size_now(ps), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduces `tensor` across the process set; returns a new tensor (differentiable).

    `tf.IndexedSlices` are allgathered (values and indices) and returned as `IndexedSlices`.

    Raises:
        ValueError: not initialised, unsupported dtype, both `op` and `average`.
        NotImplementedError: a `tf.IndexedSlices` with an op other than Sum or Average, or
            with a prescale or postscale factor (as in Horovod).
        HorovodInternalError: the op failed on some rank (e.g. shapes differ across ranks).
    """
    op = resolve_op(op, average)
    _no_effect(device_dense=device_dense, device_sparse=device_sparse)
    check_compressor(compression)
    name = _name(name, ignore_name_scope)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor,
                                 process_set)
    t = eager(tensor)
    compressed, ctx = compression.compress(t)
    out = _allreduce_list([compressed], name, op, prescale_factor, postscale_factor,
                          process_set, grouped=False)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """Allreduces a list as one atomic group (negotiated and fused together); differentiable.

    `tf.IndexedSlices` entries are allgathered on their own.

    Raises:
        NotImplementedError: as `allreduce`, for any `tf.IndexedSlices` entry.
    """
    op = resolve_op(op, average)
    _no_effect(device_dense=device_dense, device_sparse=device_sparse)
    check_compressor(compression)
    name = _name(name, ignore_name_scope)
    tensors = list(tensors)
    out: list[Any] = [None] * len(tensors)
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, _grad_name(name, f"sparse{i}") if name else None, op,
                                       prescale_factor, postscale_factor, process_set)
    if dense_idx:
        pairs = [compression.compress(eager(tensors[i])) for i in dense_idx]
        reduced = _allreduce_list([c for c, _ in pairs], name, op, prescale_factor,
                                  postscale_factor, process_set, grouped=True)
        for i, r, (_, ctx) in zip(dense_idx, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


# -- allgather ----------------------------------------------------------------------------------------
def _allgather_list(ts: list[tf.Tensor], name: str | None, ps: ProcessSet,
                    grouped: bool) -> list[tf.Tensor]:
    _check(ts)
    for t in ts:
        if t.shape.rank == 0:
            raise ValueError("allgather needs a tensor with at least one dimension (it "
                             "concatenates along dim 0); reshape a scalar to [1]")

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return _run(lambda e: _k_allgather(e, name, ps, grouped), xs, [x.dtype for x in xs],
                    [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs])

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = _allreduce_list(dys, _grad_name(name), ReduceOp.AVERAGE, 1.0, 1.0, ps,
                                  grouped)
        rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in ts])
        dims = _allgather_list([tf.reshape(rows, [1, -1])], _grad_name(name, "grad.dims"), ps,
                               False)[0]
        before = tf.reduce_sum(dims[:process_set_rank(ps)], axis=0)
        return [r[before[i]:before[i] + rows[i]] for i, r in enumerate(reduced)]
    return _differentiable(forward, backward, ts)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenates every rank's tensor along dim 0 (dim-0 sizes may differ); differentiable."""
    return _allgather_list([eager(tensor)], _name(name, ignore_name_scope), process_set,
                           grouped=False)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """List form of `allgather` (one atomic group)."""
    return _allgather_list([eager(t) for t in tensors], _name(name, ignore_name_scope),
                           process_set, grouped=True)


# -- broadcast ------------------------------------------------------------------------------------------
def _broadcast_one(t: tf.Tensor, root_rank: int, name: str | None,
                   ps: ProcessSet) -> tf.Tensor:
    _check([t])

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return _run(lambda e: _k_broadcast(e, root_rank, name, ps), xs, [t.dtype], [t.shape])

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = _allreduce_list(dys, _grad_name(name), ReduceOp.AVERAGE, 1.0, 1.0, ps, False)
        if collective.rank() != root_rank:
            return [tf.zeros_like(r) for r in reduced]
        return reduced
    return _differentiable(forward, backward, [t])[0]


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Returns global rank `root_rank`'s tensor on every rank; differentiable.

    Raises:
        ValueError: root not in the process set (plus the common errors).
    """
    return _broadcast_one(eager(tensor), root_rank, _name(name, ignore_name_scope), process_set)


def broadcast_(variables: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrites each variable with rank `root_rank`'s value, in place.

    Takes one variable or a list; returns the same (assigned) variables.
    """
    single = not isinstance(variables, (list, tuple))
    vs = [variables] if single else list(variables)
    values = [tf.convert_to_tensor(v) for v in vs]
    _check(values)
    outs = _run(lambda e: _k_broadcast(e, root_rank, name, process_set), values,
                [v.dtype for v in values], [v.shape for v in values])
    assigns = [v.assign(o) for v, o in zip(vs, outs)]
    if not tf.executing_eagerly():
        with tf.control_dependencies(assigns):
            return vs[0] if single else vs
    return vs[0] if single else vs


# -- alltoall ------------------------------------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends `splits[r]` dim-0 slices to rank r (an even split when None) and concatenates what
    arrives. Returns the output when `splits` is None, else `(output, received_splits)`;
    differentiable (the gradient is an alltoall with the received splits).

    Raises:
        ValueError: bad splits (wrong length, negative, not whole row counts, more rows
            than the tensor has).
    """
    t = eager(tensor)
    _check([t])
    name = _name(name, ignore_name_scope)
    sp = None
    if splits is not None:
        # Passed on as given: the op checks the values (whole row counts, never truncated)
        # when it is queued. Non-integer splits known now (always, eagerly; constants in a
        # graph being traced) are checked here, so a bad value fails at the call.
        sp = tf.convert_to_tensor(splits)
        if not sp.dtype.is_integer:
            known = tf.get_static_value(sp)
            if known is not None:
                sp = tf.constant(splits_values(known, name, collective.rank()))
    nset = process_set_size(process_set)

    def run(x: tf.Tensor, s: tf.Tensor | None, nm: str | None) -> list[tf.Tensor]:
        inputs = [x] if s is None else [x, s]
        return _run(lambda e: _k_alltoall(e[0], e[1] if len(e) > 1 else None, nm, process_set),
                    inputs, [x.dtype, tf.int32],
                    [tf.TensorShape([None]).concatenate(x.shape[1:]), tf.TensorShape([nset])])

    received: list[tf.Tensor] = []

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        out, rec = run(xs[0], sp, name)
        received.append(rec)
        return [out]

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        g = run(dys[0], received[0], _grad_name(name))[0]
        # Rows the splits left unsent (the last ones) had no effect: zeros, as in torch's.
        missing = tf.shape(t)[0] - tf.shape(g)[0]
        pad = tf.zeros(tf.concat([[missing], tf.shape(g)[1:]], 0), dtype=g.dtype)
        return [tf.concat([g, pad], 0)]
    out = _differentiable(forward, backward, [t])[0]
    return out if splits is None else (out, received[0])


# -- reducescatter ---------------------------------------------------------------------------------
def _rs_shape(shape: tf.TensorShape, ps: ProcessSet) -> tf.TensorShape:
    if shape.rank is None or shape.rank == 0 or shape[0] is None:
        return tf.TensorShape(None) if shape.rank is None else \
            tf.TensorShape([None]).concatenate(shape[1:])
    n, r = process_set_size(ps), process_set_rank(ps)
    rows = shape[0] // n + (1 if r < shape[0] % n else 0)
    return tf.TensorShape([rows]).concatenate(shape[1:])



def _reducescatter_list(ts: list[tf.Tensor], name: str | None, op: ReduceOp, pre: float,
                        post: float, ps: ProcessSet, grouped: bool) -> list[tf.Tensor]:
    _check(ts)

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return _run(lambda e: _k_reducescatter(e, name, op, pre, post, ps, grouped), xs,
                    [x.dtype for x in xs], [_rs_shape(x.shape, ps) for x in xs])

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        factor = pre * post * (process_set_size(ps) if op == ReduceOp.SUM else 1)
        if factor != 1.0:
            dys = [d * tf.cast(factor, d.dtype) for d in dys]
        return _allgather_list(dys, _grad_name(name), ps, grouped)
    return _differentiable(forward, backward, ts)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces across the set, then returns this rank's share of dim 0 (the first dim0 % size
    ranks get one row more); differentiable.

    Raises:
        HorovodInternalError: op other than Sum or Average.
    """
    op = reducescatter_op(op)
    _no_effect(device_dense=device_dense)
    check_compressor(compression)
    compressed, ctx = compression.compress(eager(tensor))
    out = _reducescatter_list([compressed], _name(name, ignore_name_scope), op,
                              prescale_factor, postscale_factor, process_set, False)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                          name: str | None = None,
                          ignore_name_scope: bool = False) -> list[tf.Tensor]:
    """List form of `reducescatter` (one atomic group). The positional parameters are
    Horovod's, in its order; `name` and `ignore_name_scope` (ringvod's) are keyword-only."""
    op = reducescatter_op(op)
    _no_effect(device_dense=device_dense)
    check_compressor(compression)
    pairs = [compression.compress(eager(t)) for t in tensors]
    outs = _reducescatter_list([c for c, _ in pairs], _name(name, ignore_name_scope), op,
                               prescale_factor, postscale_factor, process_set, True)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# -- join -----------------------------------------------------------------------------------------
def join() -> Any:
    """Signals that this rank has no more data (joined ranks contribute zeros to allreduces);
    blocks until every rank has joined and returns the last rank to join, as a scalar int32
    tensor (Horovod's op), eagerly and inside a `tf.function`."""
    if tf.executing_eagerly():
        return tf.constant(collective.join(), dtype=tf.int32)
    out = tf.py_function(lambda: tf.constant(collective.join(), tf.int32), [], tf.int32)
    out.set_shape([])
    return out
