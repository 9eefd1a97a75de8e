"""`hvd.elastic` for TensorFlow 2 (`horovod.tensorflow.elastic`): `run`, `TensorFlowKerasState`,
`TensorFlowState`.

The retry loop, `State`, `ObjectState` and the rendezvous with the driver are framework-neutral
(`collective/elastic.py`); this module adds states that hold TensorFlow variables:

| state | save / restore | sync (from rank 0) |
|---|---|---|
| `TensorFlowKerasState(model, optimizer)` | numpy copies of the model's and optimizer's variables / `assign` | `broadcast_variables` |
| `TensorFlowState(variables)` | numpy copies of the variables / `assign` | `broadcast_variables` |
| other keyword arguments | `ObjectState` attributes | `broadcast_object` |
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Sequence

import tensorflow as tf

import collective
from collective.elastic import HostUpdateResult, ObjectState, State, run_fn
from collective.elastic import reset as _reset
from collective.errors import (CollectiveTimeoutError, HorovodInternalError, MismatchError,
                               ShutdownError, StallError)

from .functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HostUpdateResult"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of an elastic training function `func(state, *args, **kwargs)`.

    On a failed collective the state is restored to the last commit; on a host update it is
    kept. Either way the job resets (`shutdown()`, rendezvous with the driver, `init()`), the
    state is synced from the new rank 0, the reset callbacks run, and `func` is called again.

    A collective that fails inside a `tf.function` (e.g. the gradient allreduce of Keras'
    `fit`) reaches Python as a `tf.errors.OpError` whose text carries the collective's error;
    it is turned back into that error (`HorovodInternalError` or its subclass), so that it
    restores the last commit like a failure in eager code, or, a `MismatchError`, is raised
    to the caller as in eager code.
    """
    return run_fn(_raise_internal_errors(func), _reset)


# The errors a collective raises, by the name TensorFlow's text gives them ("Name: message").
_INTERNAL = {c.__name__: c for c in (HorovodInternalError, MismatchError, ShutdownError,
                                      CollectiveTimeoutError, StallError)}
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): (.*)$", re.M)


def _raise_internal_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as exc:
            # The first such line is the exception the collective raised: raised again as
            # its own class, so that `run` tells a failure to retry from one to report (a
            # MismatchError, which every new world would meet again).
            for m in _ERROR_LINE.finditer(str(exc)):
                cls = _INTERNAL.get(m.group(1))
                if cls is not None:
                    raise cls(m.group(2)) from exc
            raise
    return wrapper


def _bcast(obj: Any) -> Any:
    return broadcast_object(obj, 0, name="elastic.state")


class _VariablesState(ObjectState):
    """An `ObjectState` that also saves, restores and syncs a list of TensorFlow variables,
    returned by `_variables()` (read at every call, so variables created later count)."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_vars: list[tuple[Any, Any]] = []  # (variable, its committed value)
        super().__init__(bcast_object=_bcast, get_rank=collective.rank, **kwargs)
        self._save_vars()

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def _save_vars(self) -> None:
        self._saved_vars = [(v, v.numpy().copy()) for v in self._variables()]

    def save(self) -> None:
        self._save_vars()
        super().save()

    def restore(self) -> None:
        """Assigns the committed values back. Variables created after the last commit (a
        subclassed model is built by its first batch) have none and keep theirs: the sync
        after the reset makes them rank 0's on every rank."""
        for v, saved in self._saved_vars:
            v.assign(saved)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_vars()
        super().sync()


class TensorFlowKerasState(_VariablesState):
    """Elastic state of a Keras model and its optimizer, plus plain values.

    `commit()` keeps numpy copies of `model.variables` and `optimizer.variables` in memory,
    `restore()` assigns them back, `sync()` broadcasts them from rank 0. The optimizer of a
    built model is built (its slots created) before any of these if it is not yet, so that a
    worker that joins later has the same variables as the survivors. `backend` is accepted for Horovod compatibility (unused).

    Example:
        >>> state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
        >>> state.model, state.optimizer, state.epoch
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self.backend = backend
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        out = list(self.model.variables)
        opt = self.optimizer
        if opt is not None:
            opt_vars = opt.variables
            out += list(opt_vars() if callable(opt_vars) else opt_vars)
        return out

    def _build_optimizer(self) -> None:
        opt = self.optimizer
        if (opt is not None and getattr(self.model, "built", False)
                and getattr(opt, "built", True) is False and hasattr(opt, "build")):
            opt.build(self.model.trainable_variables)

    def _save_vars(self) -> None:
        self._build_optimizer()
        super()._save_vars()

    def restore(self) -> None:
        self._build_optimizer()
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        super().sync()

    def reset(self) -> None:
        """After every reset: Keras' compiled train, test and predict steps are traced again at
        their next use, so that they take the new world's size (a step traced in a world of
        one rank leaves the gradient reduction out; sparse gradients are averaged over the
        size seen at tracing)."""
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(self.model, attr, None) is not None:
                setattr(self.model, attr, None)
        super().reset()


class TensorFlowState(_VariablesState):
    """Elastic state of a list of `tf.Variable`s, plus plain values. `session` is for TF1
    graphs and must be None.

    Example:
        >>> state = hvd.elastic.TensorFlowState([w, b], step=0)
    """

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("session= is for TF1 graphs, which ringvod does not support; "
                             "pass session=None (TF2, eager)")
        self.variables = list(variables or [])
        self.session = None
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return self.variables
