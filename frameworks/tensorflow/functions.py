"""Helpers that make ranks agree: `broadcast_variables`, `broadcast_object`,
`broadcast_object_fn`, `allgather_object`.

Objects travel cloudpickled as uint8 tensors: the size first (`<name>.sz`), then the bytes
(`<name>.t`). These run eagerly (they return Python objects); `session` is accepted for Horovod
compatibility and must be None (TF1 sessions are not supported).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from collective import ProcessSet, global_process_set

from .. import _common
from .mpi_ops import _check, _k_broadcast, _run

__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object"]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assigns rank `root_rank`'s values to `variables` (tf.Variable or Keras variables) on every
    rank. All broadcasts are started at once, then waited for. Eagerly the assignment happens at
    once; inside a `tf.function` the returned op (a `tf.group`) does it. `inplace` is accepted for
    Horovod compatibility (ringvod always assigns).

    The state of Keras 3's `SeedGenerator`s (variables named `seed_generator_state`, which
    `model.variables` lists) is left alone, as `BroadcastGlobalVariablesCallback` leaves it:
    broadcast, every rank would draw the root's dropout masks for the rest of training.

    Raises:
        HorovodInternalError: ranks passed different shapes or dtypes for a variable.
    """
    vs = [v for v in variables if not _is_seed_state(v)]
    if not vs:
        return tf.no_op() if not tf.executing_eagerly() else None
    values = [tf.convert_to_tensor(v) for v in vs]
    _check(values)
    outs = _run(lambda e: _k_broadcast(e, root_rank, "broadcast_variables", process_set),
                values, [v.dtype for v in values], [v.shape for v in values])
    assigns = [v.assign(o) for v, o in zip(vs, outs)]
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def _is_seed_state(v: Any) -> bool:
    """A Keras 3 `SeedGenerator`'s state variable (the name Keras gives it; the same on every
    rank)."""
    return getattr(v, "name", None) == "seed_generator_state" and not getattr(
        v, "trainable", False)


def _session(session: Any) -> None:
    if session is not None:
        raise ValueError("session= is for TF1 graphs, which ringvod does not support; call "
                         "this eagerly (TF2) with session=None")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns rank `root_rank`'s `obj` (cloudpickled) on every rank of the process set.

    `name` defaults to "broadcast_object" (Horovod used the type's name, which differs between
    the root's object and the placeholders other ranks pass).
    """
    _session(session)
    return _common.broadcast_object(obj, root_rank, name or "broadcast_object", process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """Returns `fn(obj)` that broadcasts `obj` from `root_rank` (Horovod's reusable form)."""
    _session(session)

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, None, name, process_set)
    return fn


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns the list of every rank's `obj`, indexed by rank in the process set."""
    _session(session)
    return _common.allgather_object(obj, name or "allgather_object", process_set)