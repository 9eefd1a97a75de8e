"""`hvd.elastic` for PyTorch (`horovod.torch.elastic`): `run`, `TorchState`, `ElasticSampler`.

Split as in Horovod: `sampler` holds `ElasticSampler`, `state` holds `TorchState` and the
handlers for models, optimizers and samplers (`horovod.torch.elastic.sampler`,
`horovod.torch.elastic.state`). The framework-neutral parts (the retry loop, `State`,
`ObjectState`, the rendezvous with the driver) are in `collective/elastic.py`.
"""
from __future__ import annotations

from typing import Any, Callable

from collective.elastic import HostUpdateResult, ObjectState, State, run_fn
from collective.elastic import reset as _reset

from .._handles import handles
from .sampler import ElasticSampler
from .state import (ModelStateHandler, OptimizerStateHandler, SamplerStateHandler,
                    StateHandler, TorchState, get_handler_registry, set_handler_registry)

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostUpdateResult",
           "get_handler_registry", "set_handler_registry", "StateHandler", "ModelStateHandler",
           "OptimizerStateHandler", "SamplerStateHandler"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of an elastic training function `func(state, *args, **kwargs)`.

    On a failed collective the state is restored to the last commit; on a host update it is
    kept. Either way the job resets (`shutdown()`, rendezvous with the driver, `init()`), the
    state is synced from the new rank 0, the reset callbacks run, and `func` is called again.
    """
    return run_fn(func, _torch_reset)


def _torch_reset() -> None:
    """The job's reset, as torch's `shutdown()` and `init()` do it: int handles of the old
    world (async ops never synchronized before the failure) are forgotten with their
    tensors."""
    handles.clear()
    _reset()
