"""`hvd.elastic` for Keras (`horovod.tensorflow.keras.elastic`, `horovod.keras.elastic`):
`run`, `KerasState`, and the callbacks that keep a state current inside `model.fit`:

* `UpdateBatchStateCallback(state)`: `state.batch` = the batches of the current epoch finished
  (0 at each epoch's end; a `fit` that begins with `state.batch` > 0 counts on from it).
* `UpdateEpochStateCallback(state)`: `state.epoch` = the epochs finished (the epoch of this
  `fit` call plus `state.epoch` when it began, so call `fit(epochs=epochs - state.epoch)`).
* `CommitStateCallback(state, batches_per_commit=1)`: `state.commit()` every
  `batches_per_commit` batches and at each epoch's end.

Put the update callbacks before `CommitStateCallback`, so that a commit saves the counters of
the batch it follows. Keras 3 cannot skip batches from a callback: after a reset mid-epoch,
start the first epoch at `state.batch` yourself (e.g. `dataset.skip(state.batch)`, see
docs/elastic.md).
"""
from __future__ import annotations

from typing import Any

import keras

from ..elastic import HostUpdateResult, ObjectState, State, TensorFlowKerasState, run

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
           "HostUpdateResult", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model and its optimizer (default: `model.optimizer`), plus
    plain values; see `TensorFlowKerasState`.

    Example:
        >>> state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at the end of every epoch.

    Raises (from `fit`):
        HostsUpdatedInterrupt: at a commit, when the driver announced a membership change.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got "
                             f"{batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` = the number of batches of the current epoch finished (0 again at
    the end of each epoch). A `fit` that begins with `state.batch` > 0 resumes an interrupted
    epoch (its data starts at that batch), so its first epoch counts on from there."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_batch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_batch = getattr(self.state, "batch", 0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self.initial_batch + batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
        self.initial_batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` = the number of epochs finished: `state.epoch` when `fit` began plus
    the epochs of this `fit` call."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
