"""GPU half of the TensorFlow tensor seam: eager tensors on a GPU to NCCL-engine arguments and back.

UNTESTED: TensorFlow's GPU build could not be installed on any machine this was developed on;
the path is built to the NCCL engine's protocol (as the torch adapter's CUDA half) but has never
run on a GPU.

* A GPU tensor is exported with DLPack (`tf.experimental.dlpack.to_dlpack`); its device pointer
  is read from the DLPack capsule (ctypes, no CuPy), and the capsule (which owns a reference
  to the tensor's buffer) travels as the `DeviceBuffer`'s object.
* Ordering: TensorFlow does not expose its compute stream to Python, so before an op is
  handed to the engine this waits until the GPU has finished TensorFlow's queued work
  (`tf.test.experimental.sync_devices()`), and before a result is returned it waits on the
  engine's completion event (`DeviceResult.synchronize()`). Correct, but host-blocking on
  both sides.
* Outputs are TensorFlow tensors allocated on the input's device (`tf.zeros`), made ready
  before the engine writes them.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import tensorflow as tf

from collective import Handle, ProcessSet, ReduceOp, RequestType

from collective.adapter import DeviceBuffer, DeviceResult, enqueue as _enqueue

__all__ = ["enqueue", "run_one", "finish"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _device_index(t: tf.Tensor) -> int:
    spec = tf.DeviceSpec.from_string(t.device)
    return int(spec.device_index or 0)


def _buffer(t: tf.Tensor) -> DeviceBuffer:
    capsule = tf.experimental.dlpack.to_dlpack(t)
    m = _DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor"))
    ptr = (m.dl_tensor.data or 0) + m.dl_tensor.byte_offset
    nbytes = t.dtype.size * int(t.shape.num_elements())
    return DeviceBuffer(ptr, nbytes, tuple(t.shape), (t, capsule))


def _allocate(shape: tuple, like: Any) -> DeviceBuffer:
    t = like.obj[0] if type(like) is DeviceBuffer else like
    with tf.device(t.device):
        out = tf.zeros(shape, dtype=t.dtype)
    tf.test.experimental.sync_devices()
    return _buffer(out)


def _args(tensors: Sequence[tf.Tensor]) -> tuple[list[DeviceBuffer], int]:
    from ._buffers import dtype_of
    for t in tensors:
        dtype_of(t.dtype)
    devs = {_device_index(t) for t in tensors}
    if len(devs) != 1:
        raise ValueError("all tensors of one op must be on the same GPU; got "
                         + ", ".join(t.device for t in tensors))
    tf.test.experimental.sync_devices()  # TF's queued writes to the inputs are done
    return [_buffer(t) for t in tensors], devs.pop()


def enqueue(kind: RequestType, tensors: Sequence[tf.Tensor], *, grouped: bool = False,
            **kwargs: Any) -> Handle:
    """`collective.adapter.enqueue` for eager GPU tensors (see the module docstring)."""
    from ._buffers import dtype_of
    bufs, dev = _args(tensors)
    outputs = None
    if kind in (RequestType.ALLREDUCE, RequestType.BROADCAST):
        outputs = [_allocate(b.shape, b) for b in bufs]
    return _enqueue(kind, bufs, dtypes=[dtype_of(t.dtype) for t in tensors],
                              shapes=[b.shape for b in bufs], device=dev,
                              ready_events=[None] * len(bufs), allocate=_allocate,
                              outputs=outputs, grouped=grouped, **kwargs)


def run_one(kind: RequestType, t: tf.Tensor, name: str | None, process_set: ProcessSet,
            op: ReduceOp, prescale: float, postscale: float, root: int) -> tf.Tensor:
    h = enqueue(kind, [t], name=name, process_set=process_set, op=op, prescale=prescale,
                postscale=postscale, root=root)
    return finish(h.wait(), t)


def finish(result: Any, like: tf.Tensor) -> Any:
    """A device result as TF tensors (alltoall: `(output, received_splits)`)."""
    if type(result) is list:
        return [finish(r, like) for r in result]
    if type(result) is DeviceResult:
        result.synchronize()
        out = result.output
        t = out.obj[0] if type(out) is DeviceBuffer else tf.constant(out.get())
        if result.kind == "alltoall":
            return t, tf.constant(result.received_splits, dtype=tf.int32)
        return t
    if type(result) is DeviceBuffer:
        return result.obj[0]
    return result
