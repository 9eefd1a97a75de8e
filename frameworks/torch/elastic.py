"""`hvd.elastic` for PyTorch: a stub until elastic training lands (issue "Elastic training").

Importing it works, so `import horovod.torch as hvd` and `hvd.elastic` exist; using any of its
names raises `NotImplementedError` that says what to do instead.
"""
from __future__ import annotations

from typing import Any

__all__ = ["run", "TorchState", "ElasticSampler", "State", "ObjectState"]

_MESSAGE = ("ringvod does not support elastic training yet (hvd.elastic.{}); run a fixed-size "
            "job (hvdrun -np N without --min-np/--max-np) and restart it from a checkpoint")


def run(func: Any) -> Any:
    """Raises:
        NotImplementedError: always (elastic training is not implemented yet).
    """
    raise NotImplementedError(_MESSAGE.format("run"))


class _Unavailable:
    _name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE.format(self._name))


class State(_Unavailable):
    """Not implemented yet."""

    _name = "State"


class ObjectState(State):
    """Not implemented yet."""

    _name = "ObjectState"


class TorchState(ObjectState):
    """Not implemented yet."""

    _name = "TorchState"


class ElasticSampler(_Unavailable):
    """Not implemented yet."""

    _name = "ElasticSampler"
