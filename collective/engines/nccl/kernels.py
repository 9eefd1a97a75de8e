"""CUDA kernels of the NCCL engine, compiled by NVRTC through CuPy at first use (no build step).

* `ringvod_batched_copy`: many device-to-device copies in one launch. The copies are cut into
  chunks of `CHUNK` bytes; block b finds its copy by a binary search over each copy's first
  block, so one launch keeps the GPU busy whatever the mix of sizes (Horovod's batched D2D
  memcpy, without its 16-copies-per-launch limit). 16-byte vector moves when both pointers are
  16-byte aligned, 4-byte moves when 4-byte aligned, bytes otherwise.
* `ringvod_scale_<dtype>`: in-place multiplication by a double factor (pre/postscale), with
  Horovod's GPU arithmetic: integers go through double and truncate toward zero, float32 and
  float64 multiply in their own type, float16 in half precision (the factor rounded to
  float16, one rounding of the product); bfloat16 through float32, rounded to nearest even.
  No CUDA headers are needed: half and bfloat16 conversions are written with PTX `cvt` and bit
  operations.

Table layout for `ringvod_batched_copy` (uint64 words): src[n], dst[n], size[n], first[n + 1],
where first[i] is the first block of copy i and first[n] the number of blocks.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...types import DataType

__all__ = ["CHUNK", "THREADS", "Kernels", "CopyStager", "copy_table"]

CHUNK = 32 * 1024  # bytes per block of the batched copy
THREADS = 256

_SOURCE = r"""
typedef unsigned long long u64;

extern "C" __global__ void ringvod_batched_copy(const u64* __restrict__ tab, int n, u64 chunk) {
    const u64* src = tab;
    const u64* dst = tab + n;
    const u64* size = tab + 2 * (u64)n;
    const u64* first = tab + 3 * (u64)n;
    const u64 b = blockIdx.x;
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= b) lo = mid; else hi = mid - 1;
    }
    const u64 beg = (b - first[lo]) * chunk;
    const u64 sz = size[lo];
    if (beg >= sz) return;
    const u64 end = beg + chunk < sz ? beg + chunk : sz;
    const u64 sp = src[lo], dp = dst[lo];
    const char* s = (const char*)sp;
    char* d = (char*)dp;
    u64 k0 = beg;
    if (((sp | dp) & 15) == 0) {
        const u64 nv = (end - beg) >> 4;
        const uint4* s4 = (const uint4*)(s + beg);
        uint4* d4 = (uint4*)(d + beg);
        for (u64 k = threadIdx.x; k < nv; k += blockDim.x) d4[k] = s4[k];
        k0 = beg + (nv << 4);
    } else if (((sp | dp) & 3) == 0) {
        const u64 nv = (end - beg) >> 2;
        const unsigned* s1 = (const unsigned*)(s + beg);
        unsigned* d1 = (unsigned*)(d + beg);
        for (u64 k = threadIdx.x; k < nv; k += blockDim.x) d1[k] = s1[k];
        k0 = beg + (nv << 2);
    }
    for (u64 k = k0 + threadIdx.x; k < end; k += blockDim.x) d[k] = s[k];
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float b2f(unsigned short b) {
    return __uint_as_float(((unsigned)b) << 16);
}
__device__ __forceinline__ unsigned short f2b(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

#define RV_LOOP for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; \
                     i += (u64)gridDim.x * blockDim.x)

extern "C" __global__ void ringvod_scale_float32(float* p, u64 n, double f) {
    const float g = (float)f; RV_LOOP p[i] *= g;
}
extern "C" __global__ void ringvod_scale_float64(double* p, u64 n, double f) {
    RV_LOOP p[i] *= f;
}
extern "C" __global__ void ringvod_scale_float16(unsigned short* p, u64 n, double f) {
    // Half-precision arithmetic, as Horovod's GPU ops (__hmul): the factor is rounded to
    // float16 first; the product of two halves is exact in float32, so one rounding follows.
    const float g = h2f(f2h((float)f)); RV_LOOP p[i] = f2h(h2f(p[i]) * g);
}
extern "C" __global__ void ringvod_scale_bfloat16(unsigned short* p, u64 n, double f) {
    const float g = (float)f; RV_LOOP p[i] = f2b(b2f(p[i]) * g);
}
extern "C" __global__ void ringvod_scale_uint8(unsigned char* p, u64 n, double f) {
    RV_LOOP p[i] = (unsigned char)trunc((double)p[i] * f);
}
extern "C" __global__ void ringvod_scale_int8(signed char* p, u64 n, double f) {
    RV_LOOP p[i] = (signed char)trunc((double)p[i] * f);
}
extern "C" __global__ void ringvod_scale_int32(int* p, u64 n, double f) {
    RV_LOOP p[i] = (int)trunc((double)p[i] * f);
}
extern "C" __global__ void ringvod_scale_int64(long long* p, u64 n, double f) {
    RV_LOOP p[i] = (long long)trunc((double)p[i] * f);
}
"""

_SCALE_NAMES = {
    DataType.FLOAT32: "float32", DataType.FLOAT64: "float64", DataType.FLOAT16: "float16",
    DataType.BFLOAT16: "bfloat16", DataType.UINT8: "uint8", DataType.INT8: "int8",
    DataType.INT32: "int32", DataType.INT64: "int64",
}


def copy_table(srcs: list[int], dsts: list[int], sizes: list[int]) -> tuple[np.ndarray, int]:
    """The kernel's table for these copies (zero-size copies dropped) and its block count."""
    if any(s == 0 for s in sizes):
        keep = [i for i, s in enumerate(sizes) if s]
        srcs = [srcs[i] for i in keep]
        dsts = [dsts[i] for i in keep]
        sizes = [sizes[i] for i in keep]
    n = len(sizes)
    tab = np.empty(4 * n + 1, dtype=np.uint64)
    tab[:n] = srcs
    tab[n:2 * n] = dsts
    sz = np.asarray(sizes, dtype=np.uint64)
    tab[2 * n:3 * n] = sz
    blocks = (sz + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)
    tab[3 * n] = 0
    np.cumsum(blocks, out=tab[3 * n + 1:])
    return tab, int(tab[4 * n]) if n else 0


class Kernels:
    """The compiled module for one process (CuPy loads it per device on first launch).

    Kernels run on CuPy's current stream of the calling thread: `before_launch()` runs before
    each launch (the NCCL engine makes its device and stream current there).
    """

    def __init__(self, cupy: Any, before_launch: Callable[[], None] = lambda: None) -> None:
        self._cp = cupy
        self._before_launch = before_launch
        self._module = cupy.RawModule(code=_SOURCE)
        self._copy = self._module.get_function("ringvod_batched_copy")
        self._scale: dict[DataType, Any] = {}
        self._sms = 0

    @staticmethod
    def can_scale(dtype: DataType) -> bool:
        return dtype in _SCALE_NAMES

    def batched_copy(self, table_ptr: int, n: int, blocks: int) -> None:
        """Runs the copies described by the device table at `table_ptr`."""
        if blocks == 0:
            return
        self._before_launch()
        self._copy((blocks,), (THREADS,), (np.uint64(table_ptr), np.int32(n), np.uint64(CHUNK)))

    def scale(self, ptr: int, count: int, dtype: DataType, factor: float) -> None:
        """Multiplies `count` elements at `ptr` by `factor` in place.

        Raises:
            ValueError: the dtype cannot be scaled (bool, 16-bit integers).
        """
        if factor == 1.0 or count == 0:
            return
        fn = self._scale.get(dtype)
        if fn is None:
            name = _SCALE_NAMES.get(dtype)
            if name is None:
                raise ValueError(f"cannot scale a tensor of dtype {dtype.label} on GPU")
            fn = self._scale[dtype] = self._module.get_function(f"ringvod_scale_{name}")
        if not self._sms:
            try:
                dev = self._cp.cuda.runtime.getDevice()
                props = self._cp.cuda.runtime.getDeviceProperties(dev)
                self._sms = int(props["multiProcessorCount"])
            except Exception:  # noqa: BLE001 - only a launch-size hint
                self._sms = 132
        blocks = max(1, min((count + THREADS - 1) // THREADS, self._sms * 8))
        self._before_launch()
        fn((blocks,), (THREADS,), (np.uint64(ptr), np.uint64(count), np.float64(factor)))


_SLOTS = 16  # staging slots: a slot is reused 16 uploads later
_H2D = 1  # cudaMemcpyHostToDevice


class CopyStager:
    """Uploads copy tables through pinned memory and launches the batched copies on `stream`.

    Each upload takes the next of `_SLOTS` pinned slots and copies it to a device table with one
    host-to-device copy on the stream; an event per slot guards its reuse (the host waits only if
    the copy from 16 uploads ago has not run yet). The slots grow (after draining the stream) when
    a table does not fit.
    """

    def __init__(self, cupy: Any, kernels: Kernels, stream: Any) -> None:
        self._cp = cupy
        self._kernels = kernels
        self._stream = stream
        self._pin: np.ndarray | None = None  # pinned host memory, _SLOTS slots
        self._pin_ptr = 0
        self._slot_words = 0
        self._slot = 0
        self._events: list[Any] = []
        self._dtab: Any = None  # device copy of the slots

    def copies(self, pack: tuple[list[int], list[int], list[int]],
               unpack: tuple[list[int], list[int], list[int]] | None) -> Callable[[], None]:
        """Uploads both tables now, launches the pack copies, returns a function for unpack."""
        tp, bp = copy_table(*pack)
        tabs = [tp]
        if unpack is not None:
            tu, bu = copy_table(*unpack)
            tabs.append(tu)
        ptrs = self._upload(tabs)
        kern = self._kernels
        kern.batched_copy(ptrs[0], (tp.size - 1) // 4, bp)
        if unpack is None:
            return lambda: None
        return lambda: kern.batched_copy(ptrs[1], (tu.size - 1) // 4, bu)

    def _upload(self, tables: list[np.ndarray]) -> list[int]:
        """Copies the tables to the device in one H2D copy; returns their device addresses."""
        words = sum(t.size for t in tables)
        if words > self._slot_words:
            self._grow(words)
        k = self._slot
        self._slot = (k + 1) % _SLOTS
        ev = self._events[k]
        if ev is not None and not ev.done:
            ev.synchronize()  # that slot's copy (16 uploads ago) has not run yet
        base = k * self._slot_words
        assert self._pin is not None
        view = self._pin[base:base + words]
        dptr = int(self._dtab.ptr)
        out, off = [], 0
        for t in tables:
            view[off:off + t.size] = t
            out.append(dptr + off * 8)
            off += t.size
        self._cp.cuda.runtime.memcpyAsync(dptr, self._pin_ptr + base * 8, words * 8, _H2D,
                                          int(self._stream.ptr))
        if ev is None:
            ev = self._events[k] = self._cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self._stream)
        return out

    def _grow(self, words: int) -> None:
        import cupyx  # only where CuPy is

        if self._pin is not None:
            self._stream.synchronize()  # old staging memory may still feed pending copies
        self._slot_words = max(8192, 1 << (words - 1).bit_length())
        self._pin = cupyx.empty_pinned((self._slot_words * _SLOTS,), dtype=np.uint64)
        self._pin_ptr = int(self._pin.ctypes.data)
        self._dtab = self._cp.cuda.alloc(self._slot_words * 8)
        self._events = [None] * _SLOTS
        self._slot = 0
