"""The one place where TensorFlow tensors become `collective.adapter.enqueue` arguments and engine results
become TensorFlow tensors again.

Host tensors travel as NumPy views of the eager tensor's own buffer (`EagerTensor._numpy()`
shares memory; no copy), and host results come back through DLPack (`from_dlpack` wraps the
engine's NumPy array; no copy). bfloat16 has no DLPack code in NumPy: it travels as uint16
words tagged `DataType.BFLOAT16` and is bit-cast back. GPU tensors are handed to `_gpu`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from collective import DataType, Handle, ProcessSet, ReduceOp, RequestType

from collective.adapter import enqueue as _enqueue, run_one as _run_one
from collective.types import CPU_DEVICE

__all__ = ["DTYPES", "dtype_of", "eager", "host_view", "aligned_empty", "to_tf", "is_gpu", "enqueue",
           "run_one", "finish"]

DTYPES: dict[tf.DType, DataType] = {
    tf.uint8: DataType.UINT8, tf.int8: DataType.INT8, tf.uint16: DataType.UINT16,
    tf.int16: DataType.INT16, tf.int32: DataType.INT32, tf.int64: DataType.INT64,
    tf.float16: DataType.FLOAT16, tf.bfloat16: DataType.BFLOAT16,
    tf.float32: DataType.FLOAT32, tf.float64: DataType.FLOAT64, tf.bool: DataType.BOOL,
}
_from_dlpack = tf.experimental.dlpack.from_dlpack


def dtype_of(dtype: tf.DType, what: str = "Tensor") -> DataType:
    """The wire dtype of a TF dtype.

    Raises:
        ValueError: no ringvod equivalent (complex, string, uint32/64, ...).
    """
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"{what} type {dtype.name} is not supported; ringvod supports "
                         + ", ".join(d.name for d in DTYPES)) from None


def eager(value: Any) -> tf.Tensor:
    """An eager tensor for a tensor, variable or array-like (variables are read)."""
    if isinstance(value, tf.Tensor):
        return value
    return tf.convert_to_tensor(value)


def is_gpu(t: tf.Tensor) -> bool:
    return "GPU" in t.device


def host_view(t: tf.Tensor) -> np.ndarray:
    """A NumPy view sharing the eager host tensor's memory (bfloat16 as uint16 words)."""
    a = t._numpy()  # no copy for host tensors (`numpy()` would copy)
    if t.dtype == tf.bfloat16:
        return a.view(np.uint16)
    return a


_ALIGN = 64  # TensorFlow's kernels require buffers aligned to EIGEN_MAX_ALIGN_BYTES


def aligned_empty(shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
    """A host output of `shape` and `like`'s dtype, 64-byte aligned so that TensorFlow can
    wrap it without a copy (the engines' `allocate` for host ops)."""
    dt = like.dtype
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + n].view(dt).reshape(shape)


def to_tf(arr: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """Wraps an engine's NumPy result as an eager tensor of `dtype` (no copy when the array is
    contiguous and aligned, as `aligned_empty` makes it)."""
    if type(arr) is not np.ndarray:
        arr = np.asarray(arr)
    if not arr.flags.c_contiguous or (arr.ctypes.data % _ALIGN and arr.size):
        out = aligned_empty(arr.shape, arr)
        np.copyto(out, arr)
        arr = out
    try:
        if dtype == tf.bfloat16:
            return tf.bitcast(_from_dlpack(arr.view(np.uint16).__dlpack__()), tf.bfloat16)
        return _from_dlpack(arr.__dlpack__())
    except BufferError:  # a read-only array (DLPack cannot mark it so): copy
        if dtype == tf.bfloat16:
            return tf.bitcast(tf.constant(arr.view(np.uint16)), tf.bfloat16)
        return tf.constant(arr)


def enqueue(kind: RequestType, tensors: Sequence[tf.Tensor], *, grouped: bool = False,
            **kwargs: Any) -> Handle:
    """`collective.adapter.enqueue` for eager tensors (all on the host, or all on one GPU).

    Raises:
        ValueError: unsupported dtype, tensors on different devices, or `enqueue`'s errors.
    """
    gpu = [is_gpu(t) for t in tensors]
    if any(gpu):
        if not all(gpu):
            raise ValueError("all tensors of one grouped op must be on the same device; got "
                             + ", ".join(t.device for t in tensors))
        from . import _gpu
        return _gpu.enqueue(kind, tensors, grouped=grouped, **kwargs)
    views = [host_view(t) for t in tensors]
    dtypes = [dtype_of(t.dtype) for t in tensors]
    return _enqueue(kind, views, dtypes=dtypes, shapes=[v.shape for v in views],
                              device=CPU_DEVICE, grouped=grouped, allocate=aligned_empty,
                              **kwargs)


def run_one(kind: RequestType, t: tf.Tensor, name: str | None, process_set: ProcessSet,
            op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0, postscale: float = 1.0,
            root: int = -1) -> tf.Tensor:
    """One single-tensor op, run and waited for; returns its output as a tensor.

    Raises:
        as `enqueue`; HorovodInternalError: the op failed on some rank.
    """
    if is_gpu(t):
        from . import _gpu
        return _gpu.run_one(kind, t, name, process_set, op, prescale, postscale, root)
    v = host_view(t)
    res = _run_one(kind, v, None, name, process_set, op, prescale, postscale, root,
                   dtype_of(t.dtype), v.shape, CPU_DEVICE, None, aligned_empty)
    return to_tf(res, t.dtype)


def finish(result: Any, like: tf.Tensor) -> tf.Tensor:
    """An engine result (NumPy array, or a GPU result) as a tensor of `like`'s dtype."""
    if isinstance(result, tf.Tensor):
        return result
    if is_gpu(like):
        from . import _gpu
        return _gpu.finish(result, like)
    return to_tf(result, like.dtype)
