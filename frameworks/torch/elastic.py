"""`hvd.elastic` for PyTorch (`horovod.torch.elastic`): `run`, `TorchState`, `ElasticSampler`.

The framework-neutral parts (the retry loop, `State`, `ObjectState`, the rendezvous with the
driver) are in `collective/elastic.py`; this module adds the handlers for models, optimizers and
samplers:

| value | save / restore | sync (from rank 0) |
|---|---|---|
| `torch.nn.Module` | deep copy of `state_dict()` / `load_state_dict` | `broadcast_parameters(state_dict, 0)` |
| `torch.optim.Optimizer` | deep copy of `state_dict()` / `load_state_dict` | `broadcast_optimizer_state(opt, 0)` |
| `ElasticSampler` | its `state_dict()` (epoch, processed_num) | `broadcast_object` of it |
| anything else | an `ObjectState` attribute | `broadcast_object` |
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterator

import torch
import torch.utils.data

import collective
from collective.elastic import HostUpdateResult, ObjectState, State, run_fn
from collective.elastic import reset as _reset

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostUpdateResult",
           "get_handler_registry", "set_handler_registry", "StateHandler"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of an elastic training function `func(state, *args, **kwargs)`.

    On a failed collective the state is restored to the last commit; on a host update it is
    kept. Either way the job resets (`shutdown()`, rendezvous with the driver, `init()`), the
    state is synced from the new rank 0, the reset callbacks run, and `func` is called again.
    """
    return run_fn(func, _reset)


class ElasticSampler(torch.utils.data.Sampler):
    """A `DistributedSampler` that resumes mid-epoch: after a reset, the samples already
    processed (as recorded by `record_batch`) are skipped and the rest is split over the new
    world.

    Args:
        dataset: the dataset (only its length is used).
        shuffle: permute the indices with `seed + epoch`.
        seed: the shuffle seed (the same on every rank).

    Example:
        >>> sampler = hvd.elastic.ElasticSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> for batch_idx, batch in enumerate(loader):
        ...     ...
        ...     sampler.record_batch(batch_idx, 32)
        >>> sampler.set_epoch(epoch + 1)   # at the end of the epoch
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch` with nothing processed (call it at the end of an epoch)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed one more batch of `batch_size` samples."""
        del batch_idx
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-reads rank and size and recomputes this rank's share of the unprocessed samples."""
        self.num_replicas = collective.size() if collective.is_initialized() else 1
        self.rank = collective.rank() if collective.is_initialized() else 0
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:  # pad with the first ones, as DistributedSampler
            padded += self.remaining_indices[:self.total_size - len(padded)]
        self.indices = padded

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


# -- handlers ------------------------------------------------------------------------------------
class StateHandler:
    """Saves, restores and syncs one value of a `TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """After a reset (rank and size may have changed)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """A value with `state_dict()` / `load_state_dict()`: commits keep a deep copy of it."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # an optimizer's also drops in-flight reductions


class ModelStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self) -> None:
        # Gradients accumulated (backward_passes_per_step) or reduced in the old world are
        # dropped: every rank of the new world starts the next step from zero.
        drop = getattr(self.value, "_hvd_reset", None)
        if drop is not None:
            drop()


class SamplerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0,
                                                    name="elastic.sampler"))

    def reset(self) -> None:
        self.value.reset()


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type]]:
    """The (value type, handler class) pairs `TorchState` consults, in order."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a PyTorch job: a model, an optimizer, samplers and plain values.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
        >>> state.epoch, state.model, state.optimizer
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            else:  # a plain value, `None` included: `state.model` is None without a model
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(obj, 0,
                                                                   name="elastic.state"),
                         get_rank=collective.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
