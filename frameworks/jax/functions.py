"""Helpers on pytrees and Python objects: `broadcast_variables` (make every rank start from rank
0's parameters), `allreduce_gradients` (average a pytree of gradients in one grouped op),
`broadcast_object` and `allgather_object` (cloudpickled objects).

A pytree is any nesting of lists, tuples, dicts and registered nodes (flax/haiku parameter
dicts, optax states) with arrays as leaves; the result has the same structure, every leaf a
JAX array (a Python number leaf comes back as a 0-d array). `None` leaves stay None.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

import collective
from collective import ProcessSet, ReduceOp, RequestType, global_process_set

from .. import _common
from ._arrays import JaxHandle
from .compression import Compression
from .ops import _start, grouped_allreduce

__all__ = ["broadcast_variables", "allreduce_gradients", "broadcast_object",
           "allgather_object"]


def broadcast_variables(variables: Any, root_rank: int = 0,
                        process_set: ProcessSet = global_process_set,
                        name: str | None = None) -> Any:
    """Rank `root_rank`'s values of a pytree of arrays (e.g. model parameters or an optax
    state), on every rank: a new pytree of the same structure. Every leaf's broadcast is started
    at once, then all are waited for.

    Typical use, before training: `params = hvd.broadcast_variables(params, root_rank=0)`.

    Raises:
        HorovodInternalError: the ranks' trees differ in structure (on every rank, naming the
            ranks; checked first, with one allgather of the tree's layout), or a leaf's shape or
            dtype differs across ranks.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
    name = name or "broadcast_variables"
    _check_same_tree([jax.tree_util.keystr(path) for path, _ in flat], name, process_set)
    if not flat:
        return variables
    wire = [_to_wire(leaf) for _, leaf in flat]
    handles: list[JaxHandle] = [
        _start(RequestType.BROADCAST, [x], "broadcast_variables", False, name=f"{name}.{i}",
               process_set=process_set, root=root_rank) for i, (x, _) in enumerate(wire)]
    return jax.tree_util.tree_unflatten(
        treedef, [back(h.wait()) for h, (_, back) in zip(handles, wire)])


def _same(x: Any) -> Any:
    return x


def _to_wire(leaf: Any) -> tuple[Any, Any]:
    """(what a leaf's broadcast sends, the function that turns the result back). A random key
    (`jax.random.key`, or a legacy uint32 `PRNGKey`; training states often hold one) travels
    as its key data viewed as int32, a type the collectives carry."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return leaf, _same
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(leaf)
        data = jax.random.key_data(leaf).view(np.int32)
        return data, lambda r: jax.random.wrap_key_data(r.view(np.uint32), impl=impl)
    if dtype == np.uint32:
        return leaf.view(np.int32), lambda r: r.view(np.uint32)
    return leaf, _same


def _check_same_tree(paths: list[str], name: str, process_set: ProcessSet) -> None:
    """Raises the same `HorovodInternalError` on every rank of `process_set` when their trees
    differ in structure: the leaves' ops would then not pair up (a leaf only some ranks have
    waits for the others, as any op only some ranks submit). Compared: the leaves' key paths
    (`paths`), not the tree definition's text, which shows static fields such as a flax
    `TrainState`'s `apply_fn` with their memory addresses."""
    layout = np.frombuffer(f"{len(paths)}:{' '.join(paths)}".encode(), dtype=np.uint8)
    sizes = collective.allgather(np.array([layout.size], dtype=np.int64),
                                 name=f"{name}.layout.sz", process_set=process_set).tolist()
    raw = collective.allgather(layout, name=f"{name}.layout", process_set=process_set).tobytes()
    seen: dict[str, list[int]] = {}
    off = 0
    for i, n in enumerate(sizes):
        seen.setdefault(raw[off:off + n].decode(), []).append(i)
        off += n
    if len(seen) > 1:
        ranks = process_set.ranks if process_set.ranks else list(range(len(sizes)))
        groups = "; ".join(f"rank(s) {', '.join(str(ranks[i]) for i in idx)}: "
                           f"{text.split(':', 1)[0]} leaves, {text.split(':', 1)[1][:200]}"
                           for text, idx in seen.items())
        raise collective.HorovodInternalError(
            f"{name}: the ranks passed pytrees of different structure ({groups}). Every rank "
            "must pass the same structure (same keys, nesting and number of leaves), e.g. "
            "parameters initialised by the same code on every rank.")


def allreduce_gradients(grads: Any, op: ReduceOp = ReduceOp.AVERAGE,
                        compression: Any = Compression.none, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Allreduces a pytree of gradients (default: the average over the process set) as one
    grouped op, so all leaves are negotiated together and fused into few buffers. Returns a
    new pytree of the same structure.

    Call it on concrete arrays, outside `jax.jit`: e.g.
    `loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)` then
    `grads = hvd.allreduce_gradients(grads)`. Every rank must pass a tree of the same
    structure, shapes and dtypes. `name` (default "allreduce_gradients") keys the op across
    ranks; give two different trees reduced in one step different names.

    Raises:
        HorovodInternalError: a leaf's shape or dtype differs across ranks (trees with a
            different number of leaves wait instead: see docs/jax.md); ValueError /
            NotImplementedError / TypeError as `allreduce`.
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    if not leaves:
        return grads
    reduced = grouped_allreduce(leaves, name=name or "allreduce_gradients",
                                compression=compression, op=op,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)
    return jax.tree_util.tree_unflatten(treedef, reduced)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns rank `root_rank`'s `obj` (cloudpickled) on every rank of the process set."""
    return _common.broadcast_object(obj, root_rank, name or "broadcast_object", process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns the list of every rank's `obj` (cloudpickled), indexed by rank in the set."""
    return _common.allgather_object(obj, name or "allgather_object", process_set)