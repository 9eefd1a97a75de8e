"""Leaf value types: enums for ops and dtypes, and the Request/Response messages of negotiation.

The integer values follow Horovod's wire enums so that `hvd.Sum == 1` etc. keep working.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ReduceOp",
    "RequestType",
    "ResponseType",
    "DataType",
    "Request",
    "Response",
    "dtype_of",
    "numpy_dtype",
    "CPU_DEVICE",
]

CPU_DEVICE = -1


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


class RequestType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7


class ResponseType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    ERROR = 8


class DataType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9
    BFLOAT16 = 10  # ringvod extension; stored as 16-bit words on the host

    @property
    def label(self) -> str:
        """The name Horovod's error texts use (`float32`, `int64`, ...)."""
        return self.name.lower()

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT64, DataType.BFLOAT16)


_ITEMSIZE = {
    DataType.UINT8: 1, DataType.INT8: 1, DataType.UINT16: 2, DataType.INT16: 2,
    DataType.INT32: 4, DataType.INT64: 8, DataType.FLOAT16: 2, DataType.FLOAT32: 4,
    DataType.FLOAT64: 8, DataType.BOOL: 1, DataType.BFLOAT16: 2,
}

_FROM_NUMPY = {
    np.dtype(np.uint8): DataType.UINT8, np.dtype(np.int8): DataType.INT8,
    np.dtype(np.uint16): DataType.UINT16, np.dtype(np.int16): DataType.INT16,
    np.dtype(np.int32): DataType.INT32, np.dtype(np.int64): DataType.INT64,
    np.dtype(np.float16): DataType.FLOAT16, np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64, np.dtype(np.bool_): DataType.BOOL,
}

_TO_NUMPY = {v: k for k, v in _FROM_NUMPY.items()}
# bfloat16 has no numpy dtype: host buffers hold its bits as uint16 (engines upcast to reduce).
_TO_NUMPY[DataType.BFLOAT16] = np.dtype(np.uint16)


def dtype_of(array: np.ndarray) -> DataType:
    """Maps a numpy dtype to a DataType.

    Raises:
        ValueError: the dtype has no DataType (complex, object, strings, ...).
    """
    try:
        return _FROM_NUMPY[array.dtype]
    except KeyError:
        raise ValueError(f"Tensor type {array.dtype} is not supported.") from None


def numpy_dtype(dtype: DataType) -> np.dtype:
    return _TO_NUMPY[dtype]


@dataclass(slots=True)
class Request:
    """What one rank asks for one tensor; sent to the process set's rank 0 on the slow path."""

    rank: int  # process-set-relative rank of the sender
    type: RequestType
    name: str
    dtype: DataType = DataType.FLOAT32
    shape: tuple[int, ...] = ()
    device: int = CPU_DEVICE
    root: int = -1  # global rank (broadcast only)
    reduce_op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    group_id: int = -1  # local only: members of one grouped op
    # A digest of how the tensor is assembled from smaller ones (0: not assembled), compared
    # across ranks like the shape: a gradient bucket's member shapes (`ops.enqueue(layout=)`).
    layout: int = 0

    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class Response:
    """The coordinator's decision for one (possibly fused) batch of tensors."""

    type: ResponseType
    names: list[str]
    dtype: DataType = DataType.FLOAT32
    device: int = CPU_DEVICE
    # ALLREDUCE/REDUCESCATTER: element count per tensor; ALLGATHER: dim-0 of every rank per
    # tensor, concatenated (len = n_tensors * size).
    sizes: list[int] = field(default_factory=list)
    reduce_op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    error: str = ""
    last_joined_rank: int = -1
    # Shapes per tensor (for zeros on joined ranks and for the timeline).
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    def split(self) -> list["Response"]:
        """Splits a fused response back into one response per tensor."""
        if len(self.names) == 1:
            return [self]
        out = []
        per = len(self.sizes) // len(self.names) if self.sizes else 0
        for i, name in enumerate(self.names):
            out.append(Response(
                type=self.type, names=[name], dtype=self.dtype, device=self.device,
                sizes=self.sizes[i * per:(i + 1) * per] if per else [],
                reduce_op=self.reduce_op, prescale=self.prescale, postscale=self.postscale,
                root=self.root, shapes=[self.shapes[i]] if self.shapes else [],
            ))
        return out
