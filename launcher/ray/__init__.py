"""ringvod on Ray (behind `horovod.ray`): `RayExecutor`, `BaseHorovodWorker`, and a Ray Train
trainer, `HorovodTrainer` with `HorovodConfig`.

Needs Ray (`pip install ".[ray]"` from a ringvod clone: the `ray` extra installs `ray[train]`);
without it, importing this package raises an ImportError that says so. Nothing else in ringvod
imports Ray.
"""
from __future__ import annotations

import importlib

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "HorovodTrainer",
           "HorovodConfig", "WorkerLostError"]

RAY_EXTRA_HINT = ('install it with the `ray` extra: pip install ".[ray]" from a ringvod clone '
                  '(or pip install "ray[train]")')


def _require_ray() -> None:
    try:
        importlib.import_module("ray")
    except ImportError as exc:
        raise ImportError(f"ringvod's Ray integration (horovod.ray) needs Ray, which is not "
                          f"installed: {RAY_EXTRA_HINT}") from exc


_require_ray()

from .elastic import ElasticRayExecutor  # noqa: E402
from .executor import RayExecutor, WorkerLostError  # noqa: E402
from .worker import BaseHorovodWorker  # noqa: E402

_TRAIN = ("HorovodTrainer", "HorovodConfig")


def __getattr__(name: str):  # Ray Train is imported only when its classes are asked for
    if name in _TRAIN:
        from . import train  # noqa: PLC0415
        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
