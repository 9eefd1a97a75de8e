"""`ElasticRayExecutor`: Horovod's deprecated elastic executor (not available in ringvod yet)."""
from __future__ import annotations

from typing import Any

__all__ = ["ElasticRayExecutor"]

_NOT_YET = ("elastic jobs on Ray are not available in ringvod yet; use a static RayExecutor "
            "(num_workers=...) or HorovodTrainer with Ray Train's FailureConfig")


class ElasticRayExecutor:
    """Deprecated in Horovod 0.25 for `RayExecutor(min_workers=...)`; neither is available
    yet: constructing one raises NotImplementedError."""

    @staticmethod
    def create_settings(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(_NOT_YET)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_NOT_YET)
