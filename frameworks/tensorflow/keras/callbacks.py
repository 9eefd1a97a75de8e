"""Horovod's Keras callbacks for Keras 3 (`hvd.callbacks.*`).

* `BroadcastGlobalVariablesCallback(root_rank)`: at the end of the first batch (when the
  optimizer's slots exist), sets every rank's model and optimizer variables to the root's, once
  (not the random state of Keras' seed generators: dropout masks stay each rank's own).
* `MetricAverageCallback()`: at each epoch's end, averages every numeric entry of `logs` across
  ranks (one allreduce, keys sorted). Put it before callbacks that read metrics.
* `LearningRateScheduleCallback(initial_lr, multiplier, ...)`: lr = initial_lr * multiplier
  over [start_epoch, end_epoch), per epoch (`staircase`) or per batch (fractional epoch), with
  momentum correction (momentum * new_lr / old_lr for the batch where lr changes).
* `LearningRateWarmupCallback(initial_lr, warmup_epochs=5, ...)`: ramps lr linearly from
  initial_lr / size to initial_lr over the warm-up epochs (Goyal et al., 2017).
* `BestModelCheckpoint(monitor='val_loss', ...)`: `ModelCheckpoint` with `save_best_only=True`
  whose `filepath` may be set later.
"""
from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

import collective

from .._reduce import _ref
from ..functions import broadcast_variables
from ..mpi_ops import _no_effect, allreduce
from .optimizer import LiveMomentum

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


def _is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and optimizer's variables from `root_rank` after the first batch.

    The random state of Keras 3's `SeedGenerator`s (Dropout's, for one) is not broadcast:
    each rank keeps drawing its own dropout masks, as under tf.keras (whose model variables
    held no random state). `device` has no effect (a warning says so, once). Variables
    registered with `register_local_var` (or passed as `local_variables`: one variable or a
    collection) keep each rank's own value; a Keras variable and the `tf.Variable` holding its
    value (`.value`) are the same variable.

    Raises:
        ValueError: `local_variables` holds something that is not a variable.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        _no_effect(device=device)
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local: set[Any] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
            if not all(_is_variable(v) for v in local_variables):
                raise ValueError("All local variables must be of tf.Variable type.")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var: Any) -> None:
        """Keeps `var` (a `tf.Variable` or Keras variable) out of the broadcast."""
        self._local.add(_ref(var))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        opt = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables) + (list(opt.variables) if opt is not None else [])
        # `broadcast_variables` leaves the SeedGenerators' state (dropout masks) alone itself.
        skip = self._local | _accumulators(opt)
        broadcast_variables([v for v in variables if _ref(v) not in skip], self.root_rank)
        self.broadcast_done = True


def _accumulators(opt: Any) -> set[Any]:
    """The gradients an optimizer sums locally between its steps (`gradient_accumulation_steps`,
    `backward_passes_per_step`): each rank's own, reduced at the step, never broadcast."""
    out = set()
    for o in (opt, getattr(opt, "inner_optimizer", None)):
        for v in getattr(o, "_accumulated_gradients", None) or ():
            out.add(_ref(v))
    return out


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics across ranks in `on_epoch_end` (`device` has no effect; a
    warning says so, once)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        _no_effect(device=device)
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        # Every numeric entry, vectors too (a per-class metric), in one allreduce by sorted key.
        keys = sorted(k for k, v in logs.items()
                      if isinstance(v, (int, float, np.number, np.ndarray, tf.Tensor))
                      and not isinstance(v, bool))
        arrays = [np.asarray(logs[k], dtype=np.float64) for k in keys]
        flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0)
        averaged = allreduce(tf.constant(flat, dtype=tf.float64), op=collective.Average,
                             name="MetricAverageCallback", ignore_name_scope=True).numpy()
        at = 0
        for k, a in zip(keys, arrays):
            part = averaged[at:at + a.size]
            at += a.size
            logs[k] = float(part[0]) if a.size == 1 else part.reshape(a.shape)


def _momentum_owner(opt: Any) -> Any:
    """The optimizer that holds `momentum`: a `LossScaleOptimizer` (which `compile` puts around
    the optimizer under a mixed-precision policy) has none of its own, its inner one has."""
    return getattr(opt, "inner_optimizer", opt)


def _get_momentum(opt: Any) -> float:
    m = opt.momentum
    return m.get() if isinstance(m, LiveMomentum) else float(m)


def _set_momentum(opt: Any, value: float) -> None:
    m = opt.momentum
    if isinstance(m, LiveMomentum):
        m.assign(value)
    else:  # a plain optimizer: seen by eager steps only (run_eagerly=True)
        opt.momentum = value


def _get_lr(opt: Any) -> float:
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets lr = initial_lr * multiplier(epoch) for epochs in [start_epoch, end_epoch).

    Args:
        initial_lr: the base learning rate (usually scaled by the number of ranks).
        multiplier: a constant, or a function of the (fractional) epoch.
        staircase: adjust at each epoch's start (True), or at every batch using
            epoch + batch / steps_per_epoch (False; a constant multiplier forces True).
        momentum_correction: scale the optimizer's momentum by new_lr / old_lr for the batch in
            which the learning rate changes.
        steps_per_epoch: batches per epoch; read from `fit`'s parameters when None.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        if not callable(multiplier):
            self.staircase = True
            value = float(multiplier)
            self.multiplier = lambda epoch: value
        else:
            self.multiplier = multiplier

    def _autodetect_steps_per_epoch(self) -> int:
        steps = (self.params or {}).get("steps")
        if steps:
            return int(steps)
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         "the steps_per_epoch parameter to the "
                         f"{type(self).__name__}().")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        old_lr = _get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate = new_lr
        holder = _momentum_owner(opt)
        if self.momentum_correction and hasattr(holder, "momentum") and old_lr > 0:
            self.restore_momentum = _get_momentum(holder)
            _set_momentum(holder, self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            _set_momentum(_momentum_owner(self.model.optimizer), self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = _get_lr(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        epoch = self.current_epoch or 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Linear warm-up from initial_lr / size to initial_lr over `warmup_epochs` (per batch).

    With `verbose` > 0, rank 0 prints a line when the warm-up ends (the other ranks stay quiet
    whatever their `verbose`, as in Horovod)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that each epoch ends on a round value.
            epoch += 1.0 / self.steps_per_epoch
            n = collective.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and collective.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`ModelCheckpoint(save_best_only=True)`; set `filepath` now or later (before `fit`).

    Add it on rank 0 only, as any checkpoint callback.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        placeholder = "model.weights.h5" if save_weights_only else "model.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.filepath:
            raise ValueError("BestModelCheckpoint: set .filepath before training")
        super_begin = getattr(super(), "on_train_begin", None)
        if super_begin is not None:
            super_begin(logs)
