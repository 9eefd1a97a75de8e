"""`horovod.torch.elastic.state`: `TorchState` and the handlers that save, restore and sync its
models, optimizers and samplers.

| value | save / restore | sync (from rank 0) |
|---|---|---|
| `torch.nn.Module` | deep copy of `state_dict()` / `load_state_dict` | `broadcast_parameters(state_dict, 0)` |
| `torch.optim.Optimizer` | deep copy of `state_dict()` / `load_state_dict` | `broadcast_optimizer_state(opt, 0)` |
| `ElasticSampler` | its `state_dict()` (epoch, processed_num) | `broadcast_object` of it |
| anything else (`None` included) | an `ObjectState` attribute | `broadcast_object` |
"""
from __future__ import annotations

import copy
from typing import Any

import torch

import collective
from collective.elastic import ObjectState

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "SamplerStateHandler", "get_handler_registry", "set_handler_registry"]


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
