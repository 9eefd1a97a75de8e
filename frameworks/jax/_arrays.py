"""The one place where JAX arrays become `collective.adapter.enqueue` arguments and engine results
become JAX arrays again.

Host arrays travel as NumPy views of the array's own buffer (`np.asarray` on a CPU array shares
its memory; no copy; the engine only reads it). Results come back through DLPack
(`jax.dlpack.from_dlpack` wraps the engine's 64-byte aligned NumPy output; no copy). bfloat16
(`jnp.bfloat16`, ml_dtypes' type) travels as uint16 words tagged `DataType.BFLOAT16` and comes
back with one copy (DLPack has no bfloat16 code in NumPy).

Arrays on a GPU or TPU are refused (this version moves host arrays only), and so are traced
values (the collectives run eagerly, outside `jax.jit` and other transformations).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from collective import DataType, Handle, ProcessSet, ReduceOp, RequestType
from collective.adapter import enqueue as _enqueue, run_one as _run_one
from collective.types import CPU_DEVICE, dtype_of

__all__ = ["host_view", "to_jax", "host_array", "aligned_empty", "enqueue", "run_one",
           "JaxHandle", "device_error"]

_BF16 = np.dtype(jnp.bfloat16)
_ALIGN = 64  # XLA's CPU client wraps a DLPack buffer without a copy only when it is aligned
_from_dlpack = jax.dlpack.from_dlpack


_cpu: list[Any] = []


def _host() -> Any:
    if not _cpu:
        _cpu.append(jax.devices("cpu")[0])
    return _cpu[0]


def host_array(x: Any) -> jax.Array:
    """`x` (a NumPy array, a scalar, a list) as a JAX array on the first CPU device, where
    DLPack results land too, converted as `jnp.asarray` converts it; not on JAX's default
    device, which is a GPU in a CUDA build of JAX (a NumPy input would then be refused).

    Raises:
        OverflowError: 64-bit integers out of the 32-bit range while `jax_enable_x64` is off
            (JAX would wrap them silently), as JAX raises for a Python int.
    """
    if (isinstance(x, np.ndarray) and x.dtype.kind in "iu" and x.dtype.itemsize == 8
            and x.size and not jax.config.jax_enable_x64):
        info = np.iinfo(np.int32 if x.dtype.kind == "i" else np.uint32)
        if x.min() < info.min or x.max() > info.max:
            raise OverflowError(
                f"a {x.dtype} array with values outside the {info.dtype} range (JAX converts "
                f"it to {info.dtype} while jax_enable_x64 is off, wrapping them): enable "
                "64-bit types (jax.config.update('jax_enable_x64', True)) or pass a float "
                "array")
    return jnp.asarray(x, device=_host())


def device_error(op: str, devices: Sequence[Any]) -> NotImplementedError:
    """The error for an array that lives on an accelerator (named by `devices`)."""
    where = ", ".join(f"{d} ({d.platform})" for d in devices)
    return NotImplementedError(
        f"hvd.{op}: this array is on {where}; ringvod's JAX adapter supports host (CPU) arrays "
        "only in this version. Move it to the host first, e.g. "
        "`jax.device_put(x, jax.devices('cpu')[0])`, or run JAX on the CPU "
        "(JAX_PLATFORMS=cpu).")


def host_view(x: Any, op: str) -> tuple[np.ndarray, DataType | None, np.dtype]:
    """(NumPy view of `x`'s host buffer, its wire dtype or None to read it from the view, the
    JAX dtype of the result). `x`: a JAX array, or anything `jnp.asarray` takes (a NumPy array,
    a scalar, a list), converted as JAX converts it (`host_array`) (float64 becomes float32 unless
    `jax_enable_x64` is on).

    Raises:
        NotImplementedError: `x` is on a GPU/TPU.
        TypeError: `x` is a traced value (inside `jax.jit`, `jax.grad`, `vmap`, ...).
    """
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"hvd.{op} was called on a traced value ({type(x).__name__}), inside jax.jit, "
            "jax.grad, vmap or another transformation: ringvod's JAX collectives run eagerly "
            "on concrete host arrays. Call them outside the transformed function, e.g. jit the "
            "gradient computation and pass its result to hvd.allreduce_gradients (docs/jax.md).")
    if not isinstance(x, jax.Array):
        x = host_array(x)
    devices = x.devices()
    if any(d.platform != "cpu" for d in devices):
        raise device_error(op, sorted(devices, key=str))
    a = np.asarray(x)  # no copy for a single-device CPU array
    if a.dtype == _BF16:
        return a.view(np.uint16), DataType.BFLOAT16, _BF16
    return a, None, a.dtype


def aligned_empty(shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
    """A host output of `shape` and `like`'s dtype, 64-byte aligned so that JAX can wrap it
    without a copy (the engines' `allocate` for host ops)."""
    dt = like.dtype
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + n].view(dt).reshape(shape)


def to_jax(arr: Any, dtype: np.dtype) -> jax.Array:
    """An engine's NumPy result as a JAX array of `dtype` on the default CPU device (no copy
    when it is contiguous and aligned, as `aligned_empty` makes it; the engine never touches it
    again)."""
    arr = np.asarray(arr)
    if dtype == _BF16:
        return host_array(arr.view(_BF16))
    if arr.flags.c_contiguous and arr.flags.writeable and arr.ctypes.data % _ALIGN == 0:
        try:
            return _from_dlpack(arr)
        except (BufferError, TypeError, ValueError):  # pragma: no cover - a JAX without it
            pass
    return jnp.array(arr, device=_host())


class JaxHandle:
    """The handle an `_async` function returns: `hvd.synchronize(h)` (or `h.wait()`) waits and
    returns the JAX result; `hvd.poll(h)` (or `h.done()`) never blocks. A handle may be waited
    for more than once (it returns the same result)."""

    __slots__ = ("handle", "_finish", "_result")

    def __init__(self, handle: Handle, finish: Callable[[Any], Any]) -> None:
        self.handle = handle
        self._finish = finish
        self._result: Any = None

    def __repr__(self) -> str:
        return f"<JaxHandle {self.handle.name} {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        """True once the op finished (successfully or not). Never blocks."""
        return self.handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the op finishes; returns its JAX result.

        Raises:
            TimeoutError: not finished within `timeout` seconds.
            HorovodInternalError: the op failed on this or another rank.
        """
        if self._result is None:
            self._result = self._finish(self.handle.wait(timeout))
        return self._result


def enqueue(kind: RequestType, arrays: Sequence[Any], op_label: str, *, grouped: bool = False,
            **kwargs: Any) -> tuple[Handle, list[np.dtype]]:
    """`collective.adapter.enqueue` for host arrays; returns the runtime's handle and the JAX
    dtypes of the results.

    Raises:
        as `host_view`; ValueError: unsupported dtype, or `enqueue`'s errors (not initialised,
            duplicate name, bad process set, root or splits).
    """
    views, wire, dtypes = [], [], []
    for x in arrays:
        v, dt, jdt = host_view(x, op_label)
        views.append(v)
        wire.append(dt)
        dtypes.append(jdt)
    h = _enqueue(kind, views, dtypes=None if not any(wire) else _wire(views, wire),
                 device=CPU_DEVICE, grouped=grouped, allocate=aligned_empty, **kwargs)
    return h, dtypes


def _wire(views: list[np.ndarray], wire: list[DataType | None]) -> list[DataType]:
    return [dt if dt is not None else dtype_of(v) for v, dt in zip(views, wire)]


def run_one(kind: RequestType, x: Any, op_label: str, name: str | None,
            process_set: ProcessSet, op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
            postscale: float = 1.0, root: int = -1) -> jax.Array:
    """One single-array op, run and waited for; returns its output as a JAX array.

    Raises:
        as `enqueue`; HorovodInternalError: the op failed on some rank.
    """
    v, dt, jdt = host_view(x, op_label)
    res = _run_one(kind, v, None, name, process_set, op, prescale, postscale, root, dt,
                   None, CPU_DEVICE, None, aligned_empty)
    return to_jax(res, jdt)
