"""`Entry`: one submitted tensor waiting in a process set's tensor table.

Host tensors are numpy arrays. Device tensors are `collective.engines.device.DeviceBuffer`s
(pointer, bytes, shape, owner) or objects exposing `__cuda_array_interface__` (CuPy arrays).
`ready_event` (device ops) is a CUDA event recorded on the producer's stream after the tensor was
written: a raw `cudaEvent_t` int, a `torch.cuda.Event` (`.cuda_event`) or a `cupy.cuda.Event`
(`.ptr`); the NCCL engine's stream waits on it. See `collective/engines/device.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .handle import Handle
from .types import CPU_DEVICE, Request

__all__ = ["Entry", "default_allocate"]


def default_allocate(shape: tuple[int, ...], like: Any) -> Any:
    """Allocates a host output of `shape` with the dtype of `like` (a numpy array)."""
    return np.empty(shape, dtype=like.dtype)


@dataclass(slots=True, eq=False)
class Entry:
    request: Request
    tensor: Any  # input (numpy array for host ops; DeviceTensor for device ops)
    handle: Handle
    output: Any = None  # preallocated output (in-place ops pass the input); None = allocate
    # allocate(shape, like) -> a new output tensor of the input's dtype/device
    allocate: Callable[[tuple[int, ...], Any], Any] = default_allocate
    splits: Any = None  # alltoall: np.int32 array of counts per destination rank
    received_splits: Any = None  # alltoall: filled by the engine
    ready_event: Any = None  # device ops: event recorded on the producer's stream
    # What the handle's result is built from (set by the submitter): None = output,
    # "alltoall" = (output, received_splits), "join" = last joined rank.
    result_kind: str | None = None
    context: dict = field(default_factory=dict)  # adapter-private data (e.g. torch tensors)

    @property
    def name(self) -> str:
        return self.request.name

    @property
    def device(self) -> int:
        return self.request.device

    @property
    def is_host(self) -> bool:
        return self.request.device == CPU_DEVICE
