"""`horovod.ray.runner`, the module Horovod's `RayExecutor` lives in: `from horovod.ray.runner
import RayExecutor` works as with Horovod.

Ray Train V1's own `ray.train.horovod` (`RAY_TRAIN_V2_ENABLED=0`) imports Horovod's gloo
rendezvous `Coordinator` from here and drives it; ringvod has no such coordinator, so that import
fails with an error naming ringvod's `horovod.ray.HorovodTrainer`, which takes the same
arguments.
"""
from __future__ import annotations

from typing import Any

from .executor import RayExecutor

__all__ = ["RayExecutor"]

_NO_COORDINATOR = (
    "horovod.ray.runner.Coordinator (Horovod's gloo rendezvous, which Ray Train's own "
    "ray.train.horovod.HorovodTrainer drives) does not exist in ringvod. Use ringvod's "
    "trainer instead, with the same arguments: `from horovod.ray import HorovodTrainer, "
    "HorovodConfig` (docs/ray.md).")


def __getattr__(name: str) -> Any:
    if name == "Coordinator":
        raise ImportError(_NO_COORDINATOR)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
