"""A fake CuPy (runtime, streams, events, kernels, NCCL) over host memory, for testing the NCCL
engine's logic without a GPU.

"Device pointers" are host addresses of numpy buffers; every call runs synchronously; NCCL
collectives rendezvous between the threads of one process (loopback ranks) through a world
keyed by the unique id. `install()` puts the fakes into `sys.modules` (call it before anything
imports `collective.engines.nccl`). The batched-copy and scaling kernels are re-implemented in
numpy from the same table layout, so the engine's tables, offsets and padding are checked.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import types
from typing import Any

import numpy as np

_ids = itertools.count(0x1000, 16)
_tls = threading.local()
_lock = threading.Lock()
_worlds: dict[bytes, "_World"] = {}
calls: dict[str, int] = {}  # NCCL call counts by name, for tests
wait_log: list[tuple[int, int]] = []  # (stream, event) of every stream wait, for tests
record_log: list[tuple[int, int]] = []  # (event, stream) of every event record, for tests


def _count(name: str) -> None:
    with _lock:
        calls[name] = calls.get(name, 0) + 1


def _read(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype).copy()


def _view(ptr: int, count: int, dtype: Any) -> np.ndarray:
    nbytes = count * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def _write(ptr: int, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data)
    if data.nbytes:
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)


# -- cupy.cuda.runtime / streams / events -----------------------------------------------------
# Devices: every stream and event belongs to the device current when it was made; handle 0 is
# the legacy default stream of the *current* device. Recording an event on another device's
# stream, or launching a kernel or copy on a stream of a device that is not current, fails as
# CUDA does (cudaErrorInvalidResourceHandle).
_device_of: dict[int, int] = {}


class CUDARuntimeError(RuntimeError):
    pass


def _current_device() -> int:
    return getattr(_tls, "device", 0)


def _stream_device(stream: int) -> int:
    return _current_device() if stream == 0 else _device_of.get(stream, _current_device())


def _check_record(event: int, stream: int) -> None:
    ev_dev, st_dev = _device_of.get(event), _stream_device(stream)
    if ev_dev is not None and ev_dev != st_dev:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: event of device {ev_dev} "
                               f"recorded on a stream of device {st_dev}")


def _check_current(stream: int, what: str) -> None:
    if _stream_device(stream) != _current_device():
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: {what} on a stream of device "
                               f"{_stream_device(stream)} while device {_current_device()} is "
                               "current")


def waits() -> list[tuple[int, int]]:
    """(stream handle, device of that stream) of this thread's stream waits, for tests."""
    return getattr(_tls, "waits", [])


class _Runtime(types.ModuleType):
    def getDevice(self) -> int:
        return _current_device()

    def setDevice(self, d: int) -> None:
        _tls.device = d

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        _count("memcpyAsync")
        _outside_group("memcpyAsync")
        _check_current(stream, "memcpyAsync")
        ctypes.memmove(dst, src, size)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        assert isinstance(event, int) and event != 0, f"bad event handle {event!r}"
        _count("streamWaitEvent")  # a stream may wait on another device's event
        with _lock:
            wait_log.append((stream, event))
        if not hasattr(_tls, "waits"):
            _tls.waits = []
        _tls.waits.append((stream, _stream_device(stream)))

    def getDeviceProperties(self, d: int) -> dict:
        return {"multiProcessorCount": 4}

    def eventCreateWithFlags(self, flags: int) -> int:
        _count("eventCreate")
        ev = next(_ids)
        _device_of[ev] = _current_device()
        return ev

    def eventRecord(self, event: int, stream: int) -> None:
        assert isinstance(event, int) and event != 0, f"bad event handle {event!r}"
        _count("eventRecord")
        _check_record(event, stream)
        with _lock:
            record_log.append((event, stream))

    def eventQuery(self, event: int) -> int:
        _count("eventQuery")
        return 0  # fake work is finished at once

    def eventSynchronize(self, event: int) -> None:
        _count("eventSynchronize")

    def eventDestroy(self, event: int) -> None:
        _count("eventDestroy")


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority: int | None = None) -> None:
        self.ptr = next(_ids)
        self.device = _current_device()
        _device_of[self.ptr] = self.device
        self.engine = priority is not None  # only the NCCL engine asks for a priority

    def use(self) -> "Stream":
        _tls.uses = getattr(_tls, "uses", 0) + 1
        _tls.stream = self
        return self

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.ptr = next(_ids)
        _device_of[self.ptr] = _current_device()
        _count("Event")

    @property
    def done(self) -> bool:  # cudaEventQuery: fake work is finished at once
        _count("eventQuery")
        return True

    def record(self, stream: Any = None) -> None:
        _count("eventRecord")
        _check_record(self.ptr, 0 if stream is None else stream.ptr)

    def synchronize(self) -> None:
        pass


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else device

    def use(self) -> None:
        _tls.device = self.id

    def __enter__(self) -> "Device":
        self._prev = getattr(_tls, "device", 0)
        _tls.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _tls.device = self._prev

    @property
    def pci_bus_id(self) -> str:
        # Loopback ranks are threads of one process: give each thread its own "GPU".
        return f"fake:{threading.get_ident()}"


class _Mem:
    def __init__(self, nbytes: int) -> None:
        self._buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.ptr = int(self._buf.ctypes.data)


def alloc(nbytes: int) -> _Mem:
    return _Mem(nbytes)


class FakeArray:
    """A "device" array: numpy storage exposing `__cuda_array_interface__`."""

    def __init__(self, shape: Any, dtype: Any, fill: Any = None) -> None:
        self.a = np.empty(shape, dtype=dtype) if fill is None else np.full(shape, fill, dtype)
        self.shape = self.a.shape
        self.dtype = self.a.dtype
        self.nbytes = self.a.nbytes

    @classmethod
    def of(cls, arr: np.ndarray) -> "FakeArray":
        f = cls(arr.shape, arr.dtype)
        f.a[...] = arr
        return f

    @classmethod
    def wrap(cls, arr: np.ndarray) -> "FakeArray":
        """A device array over `arr`'s memory, without a copy (e.g. a view of another)."""
        f = cls.__new__(cls)
        f.a, f.shape, f.dtype, f.nbytes = arr, arr.shape, arr.dtype, arr.nbytes
        return f

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.a.shape, "typestr": self.a.dtype.str,
                "data": (int(self.a.ctypes.data), False), "version": 3, "strides": None}

    def get(self) -> np.ndarray:
        return self.a.copy()


def empty(shape: Any, dtype: Any = np.float32) -> FakeArray:
    return FakeArray(shape, dtype)


def zeros(shape: Any, dtype: Any = np.float32) -> FakeArray:
    return FakeArray(shape, dtype, fill=0)


# -- kernels --------------------------------------------------------------------------------
def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(v: np.ndarray) -> np.ndarray:
    u = v.astype(np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[np.isnan(v)] = 0x7FC0
    return r


_SCALE_DT = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
             "bfloat16": np.uint16, "uint8": np.uint8, "int8": np.int8, "int32": np.int32,
             "int64": np.int64}


class _Kernel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, grid: tuple, block: tuple, args: tuple, **kw: Any) -> None:
        assert not kw, kw
        # The engine must have made its stream current (kernels run on the current stream).
        assert get_current_stream().engine, f"{self.name} launched off the engine's stream"
        _check_current(get_current_stream().ptr, f"kernel {self.name}")
        _count(self.name)
        _outside_group(self.name)
        if self.name == "ringvod_batched_copy":
            tab_ptr, n, chunk = int(args[0]), int(args[1]), int(args[2])
            tab = _read(tab_ptr, (4 * n + 1) * 8, np.uint64)
            src, dst, size, first = tab[:n], tab[n:2 * n], tab[2 * n:3 * n], tab[3 * n:]
            assert grid[0] == int(first[n]), (grid, first)
            for i in range(n):
                assert int(first[i + 1]) - int(first[i]) == -(-int(size[i]) // chunk)
                ctypes.memmove(int(dst[i]), int(src[i]), int(size[i]))
            with _lock:
                calls["batched_copy_bytes"] = calls.get("batched_copy_bytes", 0) + int(
                    size[:n].sum())
            return
        dt = _SCALE_DT[self.name[len("ringvod_scale_"):]]
        ptr, count, f = int(args[0]), int(args[1]), float(args[2])
        v = _view(ptr, count, dt)
        if self.name.endswith("bfloat16"):
            v[...] = _f32_to_bf16(_bf16_to_f32(v) * np.float32(f))
        elif np.dtype(dt).kind == "f":
            if dt == np.float16:
                v[...] = (v.astype(np.float32) * np.float32(f)).astype(np.float16)
            else:
                v *= dt(f)
        else:
            v[...] = np.trunc(v.astype(np.float64) * f).astype(dt)


class RawModule:
    def __init__(self, code: str = "", **kw: Any) -> None:
        assert "ringvod_batched_copy" in code

    def get_function(self, name: str) -> _Kernel:
        return _Kernel(name)


# -- NCCL ---------------------------------------------------------------------------------------
_NP = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32,
       8: np.float64, 9: np.uint16}


class NcclError(RuntimeError):
    pass


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.vals: list[Any] = [None] * size
        self.count = 0
        self.gen = 0
        self.results: dict[int, list] = {}
        self.mail: dict[tuple[int, int], list] = {}

    def exchange(self, rank: int, value: Any) -> list:
        with self.cond:
            gen = self.gen
            self.vals[rank] = value
            self.count += 1
            if self.count == self.size:
                self.results[gen] = self.vals
                self.results.pop(gen - 4, None)
                self.vals, self.count = [None] * self.size, 0
                self.gen += 1
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: self.gen != gen, timeout=30):
                raise NcclError("fake NCCL collective timed out")
            return self.results[gen]

    def post(self, src: int, dst: int, data: np.ndarray) -> None:
        with self.cond:
            self.mail.setdefault((src, dst), []).append(data)
            self.cond.notify_all()

    def take(self, src: int, dst: int) -> np.ndarray:
        with self.cond:
            if not self.cond.wait_for(lambda: self.mail.get((src, dst)), timeout=30):
                raise NcclError("fake NCCL recv timed out")
            return self.mail[(src, dst)].pop(0)


def _reduce(arrs: list[np.ndarray], dtype: int, op: int, n: int) -> np.ndarray:
    bf = dtype == 9
    xs = [(_bf16_to_f32(a) if bf else a.astype(np.float32) if dtype == 6 else a) for a in arrs]
    if op in (0, 4):
        r = xs[0].copy()
        for x in xs[1:]:
            r = r + x
        if op == 4:
            r = r / n if np.asarray(r).dtype.kind == "f" else r // n
    elif op == 1:
        r = xs[0].copy()
        for x in xs[1:]:
            r = r * x
    elif op == 2:
        r = np.maximum.reduce(xs)
    else:
        r = np.minimum.reduce(xs)
    if bf:
        return _f32_to_bf16(np.asarray(r, dtype=np.float32))
    return np.asarray(r).astype(_NP[dtype])


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:
        if not isinstance(commId, bytes):
            raise TypeError("commId must be bytes (CuPy 14)")
        with _lock:
            self.world = _worlds.setdefault(commId, _World(ndev))
        self.rank, self.n = rank, ndev
        self.world.exchange(rank, "init")
        self.aborted = False

    def _item(self, dt: int) -> int:
        return np.dtype(_NP[dt]).itemsize

    def allReduce(self, send: int, recv: int, count: int, dt: int, op: int, stream: int) -> None:
        _count("allReduce")

        def run() -> None:
            data = _read(send, count * self._item(dt), _NP[dt])
            allv = self.world.exchange(self.rank, data)
            _write(recv, _reduce(allv, dt, op, self.n))
        _collective(run)

    def allGather(self, send: int, recv: int, count: int, dt: int, stream: int) -> None:
        _count("allGather")
        nb = count * self._item(dt)

        def run() -> None:
            allv = self.world.exchange(self.rank, _read(send, nb))
            _write(recv, np.concatenate(allv))
        _collective(run)

    def broadcast(self, send: int, recv: int, count: int, dt: int, root: int,
                  stream: int) -> None:
        _count("broadcast")
        nb = count * self._item(dt)

        def run() -> None:
            allv = self.world.exchange(self.rank, _read(send, nb) if self.rank == root else None)
            _write(recv, allv[root])
        _collective(run)

    def reduceScatter(self, send: int, recv: int, count: int, dt: int, op: int,
                      stream: int) -> None:
        _count("reduceScatter")

        def run() -> None:
            data = _read(send, count * self.n * self._item(dt), _NP[dt])
            allv = self.world.exchange(self.rank, data)
            r = _reduce(allv, dt, op, self.n)
            _write(recv, r[self.rank * count:(self.rank + 1) * count])
        _collective(run)

    def send(self, buf: int, count: int, dt: int, peer: int, stream: int) -> None:
        _count("send")
        _tls.group.append(("send", self, buf, count * self._item(dt), peer))

    def recv(self, buf: int, count: int, dt: int, peer: int, stream: int) -> None:
        _count("recv")
        _tls.group.append(("recv", self, buf, count * self._item(dt), peer))

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        pass


def _collective(run: Any) -> None:
    """Runs a collective now, or at `groupEnd` inside a group (as NCCL launches a group's
    work there: each collective reads its input then, not when it was called)."""
    group = getattr(_tls, "group", None)
    if group is None:
        run()
    else:
        group.append(("collective", run))


def _outside_group(what: str) -> None:
    # A kernel or copy issued inside an NCCL group would run before the group's collectives
    # on the GPU, whatever its place between groupStart and groupEnd: a bug in the engine.
    assert getattr(_tls, "group", None) is None, f"{what} launched inside an NCCL group"


def groupStart() -> None:
    _tls.group = []


def groupEnd() -> None:
    ops, _tls.group = getattr(_tls, "group", None) or [], None
    for op in ops:
        if op[0] == "collective":
            op[1]()
    ops = [op for op in ops if op[0] != "collective"]
    for kind, comm, buf, nb, peer in ops:
        if kind == "send":
            comm.world.post(comm.rank, peer, _read(buf, nb))
    for kind, comm, buf, nb, peer in ops:
        if kind == "recv":
            data = comm.world.take(peer, comm.rank)
            assert data.nbytes == nb, (data.nbytes, nb)
            _write(buf, data)


_NULL_STREAM = Stream(null=True)


def get_current_stream() -> Stream:
    """This thread's current stream (the null stream until a `Stream.use()`)."""
    return getattr(_tls, "stream", _NULL_STREAM)


def stream_uses() -> int:
    """How many times this thread made a stream current (for tests)."""
    return getattr(_tls, "uses", 0)


def get_unique_id() -> bytes:
    return os.urandom(128)


def install() -> None:
    """Registers fake `cupy`, `cupy.cuda`, `cupy.cuda.runtime`, `cupy.cuda.nccl`, `cupyx`."""
    cp = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    rt = _Runtime("cupy.cuda.runtime")
    nccl = types.ModuleType("cupy.cuda.nccl")
    cupyx = types.ModuleType("cupyx")
    cp.__version__ = "fake"
    cp.cuda, cp.RawModule, cp.empty, cp.zeros = cuda, RawModule, empty, zeros
    cuda.runtime, cuda.nccl, cuda.Stream, cuda.Event, cuda.Device = rt, nccl, Stream, Event, Device
    cuda.alloc = alloc
    cuda.get_current_stream = get_current_stream
    for name in ("NcclCommunicator", "NcclError", "groupStart", "groupEnd", "get_unique_id"):
        setattr(nccl, name, globals()[name])
    nccl.available = True
    nccl.get_version = lambda: 22803
    nccl.get_build_version = lambda: 22803
    cupyx.empty_pinned = lambda shape, dtype=np.float32: np.empty(shape, dtype=dtype)
    sys.modules.update({"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": rt,
                        "cupy.cuda.nccl": nccl, "cupyx": cupyx})
