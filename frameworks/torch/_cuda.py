"""CUDA half of the torch tensor seam (owned by the NCCL engine's engineer; this is a stub).

`frameworks.torch._buffers` calls exactly these two functions for tensors on a CUDA device:

* `to_collective(tensor, dtype, output) -> _buffers.CollectiveArgs`: the device-tensor object
  the NCCL engine reads (e.g. something exposing `__cuda_array_interface__`), `dtype`, shape,
  `device=tensor.device.index`, a CUDA event recorded on the current stream as `ready_event`,
  an `allocate(shape, like)` that allocates through torch's caching allocator, and the output's
  device view when `output` is given.
* `from_collective(result, like) -> torch.Tensor`: the engine's result as a torch tensor on
  `like`'s device with `like`'s dtype, ordered after the collective on the current stream.
"""
from __future__ import annotations

from typing import Any

__all__ = ["to_collective", "from_collective"]

_MESSAGE = "CUDA tensors need the NCCL engine"


def to_collective(tensor: Any, dtype: Any, output: Any = None) -> Any:
    """Raises:
        NotImplementedError: until the NCCL engine's torch seam lands.
    """
    raise NotImplementedError(_MESSAGE)


def from_collective(result: Any, like: Any) -> Any:
    """Raises:
        NotImplementedError: until the NCCL engine's torch seam lands.
    """
    raise NotImplementedError(_MESSAGE)
