"""Gradient reduction shared by `DistributedGradientTape` and the `DistributedOptimizer`s.

All dense gradients of one step are reduced by ONE call into the engines (one `tf.py_function`
inside a `tf.function`): each group is a grouped allreduce, all groups are started, then all
are waited for. With no `groups`, all dense gradients form one group (negotiated once, fused
by the engine); when a tape records the reduction (an outer tape taking second derivatives),
its gradient is the same reduction of the upstream gradients, as for `allreduce`.
`tf.IndexedSlices` are allgathered unless `sparse_as_dense`; gradients of local sources are
not reduced (scaled by 1/size when `scale_local_gradients`).

A gradient that is None on some ranks only (a layer that this rank's batch did not use) must
not leave those ranks out of the reduction: the others would wait for them forever. Eagerly,
the ranks therefore first agree on each gradient's kind (one small Max allreduce): None where
every rank has None; else ranks with None reduce zeros, and a mix of `IndexedSlices` with None
(or with dense gradients) is reduced dense. Inside a `tf.function` the kinds are fixed when
tracing, so None stays None there (every rank traces the same program); a digest of the kinds
travels with the reduction (`_digest`), so ranks that traced different kinds fail with a
`MismatchError` on every rank. The Keras `DistributedOptimizer` does the same (`align`) before
Keras drops the None gradients, so that a variable without a gradient on every rank is left
alone, as plain Keras leaves it.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import tensorflow as tf

from collective import MismatchError, ProcessSet, ReduceOp, RequestType, global_process_set

from .._common import gradient_reduction, split_list
from ._buffers import enqueue, finish
from collective.adapter import wait_now
from .compression import Compression, check_compressor
from .mpi_ops import (_check, _could_record, _differentiable, _no_effect, _run, _sparse_allreduce,
                      _size_now, allreduce, may_resize, process_set_size)

__all__ = ["GradientReducer"]

_NONE, _SPARSE, _DENSE = 0, 1, 2  # a gradient's kind, as the ranks agree on it


def _k_groups(ts: list[tf.Tensor], groups: list[list[int]], name: str, op: ReduceOp,
              pre: float, post: float, ps: ProcessSet, layout: int) -> list[tf.Tensor]:
    def start() -> list[Any]:
        return [enqueue(RequestType.ALLREDUCE, [ts[i] for i in g], grouped=True,
                        name=f"{name}.{k}", process_set=ps, op=op, prescale=pre,
                        postscale=post, layout=layout) for k, g in enumerate(groups)]

    def wait(handles: list[Any]) -> list[tf.Tensor]:
        out: list[Any] = [None] * len(ts)
        for g, h in zip(groups, handles):
            for i, r in zip(g, h.wait()):
                out[i] = finish(r, ts[i])
        return out
    return wait_now(wait, start)


class GradientReducer:
    """Horovod's gradient options, applied to one step's gradients at a time.

    Raises (at construction):
        ValueError: `gradient_predivide_factor` with an op other than Average, bad groups.
        NotImplementedError: Adasum.
    """

    def __init__(self, name: str, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: ReduceOp = ReduceOp.AVERAGE,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True, device_dense: str = "",
                 device_sparse: str = "") -> None:
        _no_effect(device_dense=device_dense, device_sparse=device_sparse)
        op, groups = gradient_reduction(op, gradient_predivide_factor, num_groups, groups)
        if groups is not None and not (isinstance(groups, int) and groups > 0) and not (
                isinstance(groups, (list, tuple))
                and all(isinstance(g, (list, tuple)) for g in groups)):
            raise ValueError("groups should be a positive int or a list of lists of variables, "
                             f"got {groups!r}")
        self.name = name
        self.compression = check_compressor(compression)
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale = 1.0 / gradient_predivide_factor
        self.postscale = gradient_predivide_factor
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local: set[Any] = set()

    def register_local_source(self, var: Any) -> None:
        """Marks a variable whose gradient stays local (not reduced)."""
        self._local.add(_ref(var))

    def is_local(self, var: Any) -> bool:
        return _ref(var) in self._local

    def _group_indices(self, dense: list[int], variables: Sequence[Any]) -> list[list[int]]:
        if self.groups is None or not dense:
            return [dense] if dense else []
        if isinstance(self.groups, int):
            return [g for g in split_list(dense, self.groups) if g]
        where = {_ref(variables[i]): i for i in dense}
        out, taken = [], set()
        for g in self.groups:
            idx = [where[_ref(v)] for v in g if _ref(v) in where]
            if idx:
                out.append(idx)
                taken.update(idx)
        out.extend([i] for i in dense if i not in taken)
        return out

    def all_true(self, flag: Any) -> Any:
        """`flag` (a boolean tensor) AND-ed across the process set, so that every rank takes
        the same branch (e.g. a loss-scale optimizer's skip of a step with non-finite
        gradients, which would otherwise skip this rank's gradient reduction only)."""
        ps = self.process_set
        if self._alone():
            return flag
        agreed = allreduce(tf.cast(flag, tf.int32), op=ReduceOp.MIN,
                           name=f"{self.name}.all_true", process_set=ps, ignore_name_scope=True)
        return tf.cast(agreed, tf.bool)

    def _alone(self) -> bool:
        """Nothing to reduce: this rank is not in the process set, or it is the set's only
        rank (unless the job is elastic and a `tf.function` is being traced: its size when
        the function runs may be another)."""
        ps = self.process_set
        if ps is not global_process_set and not ps.included():
            return True
        return process_set_size(ps) == 1 and (tf.executing_eagerly() or not may_resize())

    def _kinds(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[int]:
        """Each gradient's kind on this rank: 0 None (or a local source's), 1 IndexedSlices
        (allgathered), 2 dense."""
        kinds = []
        for g, v in zip(grads, variables):
            if g is None or self.is_local(v):
                kinds.append(_NONE)
            elif isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                kinds.append(_SPARSE)
            else:
                kinds.append(_DENSE)
        return kinds

    def align(self, grads: Sequence[Any], variables: Sequence[Any]) -> tuple[list[Any], int]:
        """Where a Keras optimizer is about to drop the None gradients: (`grads` made alike on
        every rank, 0) eagerly (`_agree_kinds`); (`grads`, the digest of their kinds) inside a
        `tf.function`, for `reduce(layout=...)`, where the kinds were fixed at tracing."""
        grads = list(grads)
        if self._alone():
            return grads, 0
        if tf.executing_eagerly():
            return self._agree_kinds(grads, variables), 0
        return grads, _digest(self._kinds(grads, variables))

    def _agree_kinds(self, grads: list[Any], variables: Sequence[Any]) -> list[Any]:
        """`grads` made alike on every rank (eager only; see the module docstring): one Max
        allreduce of each gradient's kind (0 None, 1 IndexedSlices, 2 dense) and of its
        negation gives the highest and lowest kind across the process set."""
        kinds = self._kinds(grads, variables)
        both = tf.constant(kinds + [-k for k in kinds], dtype=tf.int32)
        try:
            agreed = allreduce(both, op=ReduceOp.MAX, name=f"{self.name}.kinds",
                               process_set=self.process_set, ignore_name_scope=True).numpy()
        except MismatchError as exc:  # a list of another length on some rank
            raise MismatchError(f"{self.name}: the ranks reduce different numbers of gradients "
                                f"(this rank {len(kinds)}); every rank must pass the same "
                                f"sources/variables, in the same order ({exc})") from exc
        k = len(kinds)
        out = list(grads)
        for i, (v, hi, lo) in enumerate(zip(variables, agreed[:k], -agreed[k:])):
            if hi == _NONE or hi == lo or self.is_local(v):
                continue  # None everywhere, or the same kind everywhere
            out[i] = tf.zeros_like(v) if grads[i] is None else tf.convert_to_tensor(grads[i])
        return out

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any],
               layout: int | None = None) -> list[Any]:
        """The reduced gradients, in order (see the module docstring). `layout`: what `align`
        returned when it already ran on the step's whole list (the kinds' digest, 0 eagerly);
        None: this call agrees or digests the kinds itself."""
        grads = list(grads)
        if self._alone():
            return grads
        ps = self.process_set
        n: Any = None  # the set's size, read when first needed
        if layout is None:
            if not variables or len(variables) != len(grads):
                layout = 0
            elif tf.executing_eagerly():
                grads, layout = self._agree_kinds(grads, variables), 0
            else:
                layout = _digest(self._kinds(grads, variables))
        out: list[Any] = list(grads)
        dense: list[int] = []
        sparse: list[int] = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if variables and self.is_local(variables[i]):
                if self.scale_local_gradients:
                    if n is None:
                        n = _size_now(ps)
                    out[i] = g / tf.cast(n, g.dtype) if not isinstance(g, tf.IndexedSlices) \
                        else tf.IndexedSlices(g.values / tf.cast(n, g.dtype), g.indices,
                                              g.dense_shape)
                continue
            if isinstance(g, tf.IndexedSlices):
                if self.sparse_as_dense:
                    out[i] = g = tf.convert_to_tensor(g)
                else:
                    sparse.append(i)
                    continue
            dense.append(i)
        if dense:
            self._reduce_dense(out, dense, variables, ps, layout)
        # After the dense reduction, which carries the kinds' digest (`layout`): ranks that
        # traced different gradients fail there on every rank before any of them waits in a
        # sparse allgather the others never make (a compiled step runs these ops in order).
        for i in sparse:
            # Allgathered values are not summed, so the predivide factor (it keeps sums in
            # range) has nothing to do there, and its two factors multiply to 1.
            out[i] = _sparse_allreduce(out[i], f"{self.name}.sparse.{i}", self.op, 1.0, 1.0, ps)
        return out

    def _reduce_dense(self, out: list[Any], dense: list[int], variables: Sequence[Any] | None,
                      ps: ProcessSet, layout: int | None) -> None:
        """Reduces the dense gradients `out[i]`, i in `dense`, in place (one grouped op per
        group)."""
        pairs = {i: self.compression.compress(tf.convert_to_tensor(out[i])) for i in dense}
        order = sorted(dense)
        wire = [pairs[i][0] for i in order]
        _check(wire)
        pos = {i: k for k, i in enumerate(order)}
        groups = [[pos[i] for i in g] for g in self._group_indices(order, variables)]
        op, pre, post = self.op, self.prescale, self.postscale

        def run(ts: list[tf.Tensor], name: str) -> list[tf.Tensor]:
            return _run(lambda e: _k_groups(e, groups, name, op, pre, post, ps, layout), ts,
                        [t.dtype for t in ts], [t.shape for t in ts])
        if _could_record():  # an outer tape differentiates the reduced gradients (Hessians)
            reduced = _differentiable(lambda xs: run(xs, self.name),
                                      lambda dys: run(dys, f"{self.name}.grad"), wire)
        else:
            reduced = run(wire, self.name)
        for i, r in zip(order, reduced):
            out[i] = self.compression.decompress(r, pairs[i][1])


def _digest(kinds: list[int]) -> int:
    """A nonzero 64-bit digest of a step's gradient kinds, sent with the grouped allreduces
    of its dense gradients (`enqueue(layout=...)`): inside a `tf.function`, where the kinds
    are fixed at tracing, ranks that traced gradients for other variables (a model whose
    Python code branches on the rank) get a `MismatchError` instead of a hang or of
    different variables' gradients reduced together."""
    h = hashlib.blake2b(bytes(kinds) + len(kinds).to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(h.digest(), "little") or 1


def _ref(var: Any) -> Any:
    """A hashable key for a tf.Variable or a Keras variable."""
    inner = getattr(var, "value", None)
    if isinstance(inner, tf.Variable):
        var = inner
    return var.ref() if hasattr(var, "ref") else id(var)
