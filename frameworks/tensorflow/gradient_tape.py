"""`DistributedGradientTape` and `PartialDistributedGradientTape`.

The wrapper is an instance of a subclass of the tape's own class (so `isinstance(tape,
tf.GradientTape)` holds) that shares the wrapped tape's recording; `gradient()` computes the
local gradients, then reduces them across the process set (see `_reduce.GradientReducer`).
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from collective import ProcessSet, ReduceOp, global_process_set

from ._reduce import GradientReducer
from .compression import Compression

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedGradientTapeMixin:
    _hvd_reducer: GradientReducer

    def register_local_source(self, source: Any) -> None:
        """Keeps `source`'s gradient local: not reduced, divided by the set's size when
        `scale_local_gradients`."""
        self._hvd_reducer.register_local_source(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        """Local gradients of `target`, reduced across the process set (same structure as
        `sources`). `use_generic_names` is accepted for Horovod compatibility."""
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._hvd_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """(`(source, gradient)` pairs of the local sources, pairs of the others), each
        gradient reduced as `gradient` does, in the order of `sources` (Horovod's form)."""
        flat = tf.nest.flatten(sources)
        grads = self.gradient(target, flat, output_gradients, use_generic_names)
        local = [(s, g) for s, g in zip(flat, grads) if self._hvd_reducer.is_local(s)]
        glob = [(s, g) for s, g in zip(flat, grads) if not self._hvd_reducer.is_local(s)]
        return local, glob


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: ReduceOp = ReduceOp.AVERAGE,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wraps a `tf.GradientTape` so that `gradient()` returns gradients averaged (by `op`)
    across the process set.

    Use it after recording (`tape = hvd.DistributedGradientTape(tape)`) or around it
    (`with hvd.DistributedGradientTape(tf.GradientTape()) as tape:`).

    Raises:
        ValueError / NotImplementedError: see `GradientReducer`.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                        f"{type(gradtape).__name__}")
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTapeMixin, base), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording (`_tape`) and flags
    tape._hvd_reducer = GradientReducer(
        "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set, scale_local_gradients, device_dense, device_sparse)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: ReduceOp = ReduceOp.AVERAGE,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Sequence[Any] | Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A `DistributedGradientTape` whose `local_layers`' variables keep local gradients.

    Raises:
        ValueError: `local_layers` holds something that is not a Keras layer.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else (
        list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers])
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
