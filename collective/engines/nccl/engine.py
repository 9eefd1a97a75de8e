"""`NCCLEngine`: GPU collectives for one process set (see the package docstring)."""
from __future__ import annotations

import collections
import json
import socket
import sys
import threading
from typing import Any, Callable

import cupy
from cupy.cuda import nccl

from ... import _log
from ...entry import Entry, default_allocate
from ...errors import EngineUnavailableError, HorovodInternalError
from ...types import DataType, ReduceOp, Response, numpy_dtype
from ..base import ControlPlane, Engine
from ..device import DeviceOpError, DeviceResult, OnStream, pointer_of, set_allocation_stream
from . import layouts as _layouts
from .comm import _abort_comm, _drain, exchange_unique_id, init_communicator, versions
from .events import _Completion, _StreamDone, _event_ptr, _on_device, _ready
from .kernels import CopyStager, Kernels
from .layouts import _pad16

__all__ = ["NCCLEngine", "UnsupportedOnGPUError", "create_engine", "guest_enter", "guest_exit"]

_log_ = _log.get_logger()

STREAM_PRIORITY = -64  # the engine stream's priority (CUDA clamps; lower = higher priority)
# GIL switch interval to set when the first GPU communicator is made, if the interpreter still
# has Python's default (5 ms); None (the default) leaves the interpreter alone. Measured on
# 2x H200 (ResNet-50): 1e-4 shortened gradient hooks but did not raise throughput beyond noise.
GIL_SWITCH_INTERVAL: float | None = None

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x).
_INT8, _UINT8, _INT32, _INT64, _FLOAT16, _FLOAT32, _FLOAT64, _BFLOAT16 = 0, 1, 2, 4, 6, 7, 8, 9
_NCCL_TYPE = {
    DataType.UINT8: _UINT8, DataType.INT8: _INT8, DataType.INT32: _INT32,
    DataType.INT64: _INT64, DataType.FLOAT16: _FLOAT16, DataType.FLOAT32: _FLOAT32,
    DataType.FLOAT64: _FLOAT64, DataType.BFLOAT16: _BFLOAT16, DataType.BOOL: _UINT8,
}
_SUM, _PROD, _MAX, _MIN, _AVG = 0, 1, 2, 3, 4
_NCCL_OP = {ReduceOp.SUM: _SUM, ReduceOp.PRODUCT: _PROD, ReduceOp.MAX: _MAX,
            ReduceOp.MIN: _MIN}
_D2D = 3  # cudaMemcpyKind
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_FREE_EVENTS = 64  # completion events kept for reuse
# Finished ops are reaped (entries released, events recycled) once this many are in flight; an
# op that finds no free event makes one (a lone op's loop then cycles through this many). An
# event query is a noticeable share of a lone op's engine path (`tools/latency_probe.py`), so
# it is not done per op.
_REAP_AT = 4

# A member of a fused allreduce of this many bytes or more is reduced where it lies by an NCCL
# call of its own inside the fused op's NCCL group, instead of through the fusion buffer (whose
# two copies cost GPU time in proportion to its bytes); 0 packs every member. Each rank splits
# its members by this value, so it must be the same on every rank: the split decides the NCCL
# calls, one per such member and one for the rest, which must match across ranks.
DIRECT_BYTES = 1 << 20

_rt = cupy.cuda.runtime


class _EngineTLS(threading.local):
    # Class defaults: reading an unset thread-local attribute raises (slow) inside.
    engine: Any = None  # which engine's stream is CuPy's current stream on this thread
    guest = False  # a user thread running a cycle (`guest_enter`)
    saved: Any = None  # that thread's (device, CuPy stream) before an engine took them


_tls = _EngineTLS()


class UnsupportedOnGPUError(DeviceOpError, HorovodInternalError):
    """A dtype, op or scaling NCCL cannot run, reported at `synchronize` on every rank. Horovod
    raises `HorovodInternalError` for a failed GPU op; ringvod raised ValueError: it is both."""


class _OpError(Exception):
    """An op that every rank rejects the same way; fails its handles, not the job."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def guest_enter() -> None:
    """Before a coordinator cycle runs on a user thread (`Coordinator.drive`, the express lane).
    Engines make their device and stream current there only for work that needs them (kernels,
    CuPy allocations); `guest_exit` gives the thread its own back."""
    _tls.guest = True


def guest_exit() -> None:
    """After such a cycle: gives the thread its device and stream back if an engine took them."""
    _tls.guest = False
    saved, _tls.saved = _tls.saved, None
    _tls.engine = None
    if saved is not None:
        dev, stream = saved
        if int(_rt.getDevice()) != dev:
            _rt.setDevice(dev)
        stream.use()


def _disjoint(srcs: list[int], dsts: list[int], sizes: list[int]) -> bool:
    """Whether no two members of a fused op share memory (inputs, and outputs apart from their
    own input). Members reduced by NCCL calls of their own in one group must not: the calls
    run concurrently, where the fusion buffer's copies give the same tensor twice, or two
    views of one tensor, their sum."""
    spans = [(s, s + n) for s, n in zip(srcs, sizes) if n]
    spans += [(d, d + n) for s, d, n in zip(srcs, dsts, sizes) if n and d != s]
    spans.sort()
    end = 0
    for a, b in spans:
        if a < end:
            return False
        end = b
    return True


class NCCLEngine(Engine):
    """GPU collectives for one process set. See the module docstring."""

    name = "nccl"
    prefix = "NCCL"

    def __init__(self, control: ControlPlane, config: Any) -> None:
        super().__init__(control)
        self.config = config
        self.fusion_threshold = max(int(config.fusion_threshold), 0)
        self.device = -1
        self.comm: Any = None
        self.stream: Any = None
        self._sp = 0  # the stream's handle
        self._kernels: Kernels | None = None
        self._has_avg = False
        self._broken: BaseException | None = None
        self._inflight: collections.deque = collections.deque()  # (event, what it keeps alive)
        self._free_events: list[Any] = []  # completion events of finished ops, for reuse
        self._fusion_obj: Any = None
        self._fusion_ptr = 0
        self._fusion_bytes = 0
        self._retired_buffers: list[Any] = []  # outgrown fusion buffers (`_fusion_buffer`)
        self._stager: CopyStager | None = None  # uploads copy tables, launches the copies
        self._last_done: _Completion | _StreamDone | None = None
        # The stream the communicator's latest op was launched on: the engine's, or a caller's
        # (`_on_caller_stream`). An op launched on another stream first waits for it, so the
        # communicator's kernels never overlap.
        # (None: no op yet. A raw handle, and 0 is a real one: the legacy default stream. A
        # caller's stream destroyed with its op still running and its handle reused for a new
        # stream would look like the same stream; torch's streams are pooled, never destroyed.)
        self._tail: int | None = None
        self._caller_done: int | None = None  # event recorded after each caller-stream op
        # Entries of caller-stream ops, kept (tensors alive) until `_caller_done` fired.
        self._caller_inflight: list[list[Entry]] = []
        self._allocated: set[int] = set()  # ids of entries whose output the engine allocated
        self._zero_ids: set[int] = set()  # ids of zero tensors made for joined ranks
        self._check: Callable[[], None] | None = None  # the communicator's check_async_error
        self._reductions: dict[tuple, tuple[int, int, float, float]] = {}

    # -- binding ------------------------------------------------------------------------------
    def _ensure_device(self, device: int) -> None:
        if self.device >= 0:
            return
        if device < 0:
            device = int(_rt.getDevice())
        if _tls.guest and _tls.saved is None:
            # A user thread (a driven cycle, the express lane) binding a new set's engine: it
            # gets its own device and stream back at `guest_exit`, saved before they change.
            _tls.saved = int(_rt.getDevice()), cupy.cuda.get_current_stream()
        cupy.cuda.Device(device).use()
        self.device = device
        try:
            # CUDA clamps to the greatest priority the device has (-5 on Hopper).
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=STREAM_PRIORITY)
        except TypeError:  # CuPy without stream priorities
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._sp = int(self.stream.ptr)
        self._kernels = Kernels(cupy, self._use)
        self._activate()

    def _activate(self) -> None:
        """Makes this engine's device and stream current on the calling thread (kept on the
        coordinator thread; a guest thread's own come back at `guest_exit`)."""
        if _tls.guest and _tls.saved is None:
            _tls.saved = int(_rt.getDevice()), cupy.cuda.get_current_stream()
        if self.device >= 0 and int(_rt.getDevice()) != self.device:
            _rt.setDevice(self.device)
        self.stream.use()
        _tls.engine = self

    def _use(self) -> None:
        """Before a kernel launch or a CuPy allocation: they use the current device and stream.
        NCCL calls, event records and waits name their stream and need neither, so a lone
        op on a guest thread skips the switch and its undoing (six CuPy calls:
        `stream.use()`, `get_current_stream()`, `getDevice()` and their undoing)."""
        if _tls.engine is not self:
            self._activate()

    def _bind(self, entries: list[Entry]) -> None:
        device = next((e.device for e in entries if id(e.tensor) not in self._zero_ids), -1)
        ok, why, bus = True, "", ""
        try:
            self._ensure_device(device)
            bus = cupy.cuda.Device(self.device).pci_bus_id
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            ok, why = False, f"{type(exc).__name__}: {exc}"
        host = socket.gethostname()
        # Plain data (JSON), never pickle: nothing a peer sends runs as code.
        infos = [_setup_info(b, r) for r, b in enumerate(self.control.allgather(
            json.dumps([ok, why, host, self.device, bus]).encode()))]
        bad = [f"rank {r} ({i[2]}, cuda:{i[3]}): {i[1]}" for r, i in enumerate(infos) if not i[0]]
        if bad:
            raise HorovodInternalError("NCCL engine setup failed on " + "; ".join(bad))
        seen: dict[tuple[str, str], int] = {}
        for r, (_, _, h, dev, b) in enumerate(infos):
            if (h, b) in seen:
                raise HorovodInternalError(
                    f"ranks {seen[(h, b)]} and {r} of group {self.control.global_ranks} use the "
                    f"same GPU (cuda:{dev}, PCI {b}) on host {h}; NCCL needs one GPU per rank. "
                    "Call torch.cuda.set_device(hvd.local_rank()) (or cupy.cuda.Device(...).use()"
                    ") before the first GPU op, or give each rank its own CUDA_VISIBLE_DEVICES.")
            seen[(h, b)] = r
        info = versions()
        _log_.info("NCCL engine on cuda:%d for ranks %s: %s", self.device,
                   self.control.global_ranks, info)
        tn = info.get("torch_nccl")
        if tn is not None and tn != info.get("nccl"):
            _log_.warning(
                "CuPy loads NCCL %s but torch loads NCCL %s; ringvod's collectives use CuPy's. "
                "Install matching versions (e.g. the nvidia-nccl wheel torch was built with) if "
                "you see NCCL errors.", info.get("nccl"), tn)
        try:
            self._has_avg = int(nccl.get_version()) >= 21000
        except Exception:  # noqa: BLE001
            self._has_avg = False
        raw = exchange_unique_id(self.control)
        self.comm = self._init_comm(raw)
        if GIL_SWITCH_INTERVAL is not None and sys.getswitchinterval() == 0.005:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL)
            _log_.debug("GIL switch interval set to %g s for GPU training", GIL_SWITCH_INTERVAL)

    def _init_comm(self, raw: bytes) -> Any:
        return init_communicator(raw, self.device, self.size, self.rank,
                                 self.control.global_ranks)

    # -- per-op plumbing ----------------------------------------------------------------------
    def _run(self, label: str, fn: Callable[..., None], entries: list[Entry], *args: Any) -> None:
        try:
            if self._broken is not None:
                raise self._broken
            if self._allocated:  # the previous op's, which `finish` has read
                self._allocated.clear()
            if self.comm is None:
                self._bind(entries)
                self._check = getattr(self.comm, "check_async_error", None)
            elif int(_rt.getDevice()) != self.device:
                # A guest thread, or user code on this thread, made another device current:
                # events and CuPy work below belong to the engine's device.
                self._activate()
            if len(self._inflight) >= _REAP_AT:
                self._reap()
            if self._check is not None:
                self._check()  # an NCCL error of an earlier op (e.g. a peer died) fails this one
            sp, last = self._sp, None
            for e in entries:
                if e.device != self.device and e.device >= 0 and id(e.tensor) not in \
                        self._zero_ids:
                    raise self._other_device(e)
                ev = e.ready_event
                if type(ev) is OnStream:
                    if len(entries) == 1 and self._caller_stream_ok(label, e, args):
                        self._on_caller_stream(ev.stream, fn, entries, args)
                        return
                    ev = e.ready_event = _ready.record(ev.device, ev.stream)
                if ev is not None:
                    ev = _event_ptr(ev)
                    if ev != last:  # entries sharing one event are adjacent
                        _rt.streamWaitEvent(sp, ev, 0)
                        _ready.release(ev)  # a pooled event is recorded for one entry only
                        last = ev
            if self._tail != sp:
                self._follow(sp)
            fn(entries, *args)
            # Events of finished ops are recorded again: a result still holding one then waits
            # for a later op of this stream, which is later still (never a cycle).
            free = self._free_events
            ev = free.pop() if free else cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
            self._last_done = _Completion(ev)
            retired = self._retired_buffers
            if retired:  # fusion buffers earlier ops may still use: freed after this op
                self._inflight.append((ev, (entries, retired)))
                self._retired_buffers = []
            else:
                self._inflight.append((ev, entries))
        except _OpError as exc:
            for e in entries:
                e.handle._set_exception(exc.error)
        except BaseException as exc:  # noqa: BLE001 - handles must learn it, then the loop dies
            names = [e.name for e in entries]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                            else "")
            if isinstance(exc, HorovodInternalError):
                err: BaseException = exc
            else:
                err = HorovodInternalError(
                    f"NCCL {label} of {shown} failed on rank {self.rank} (cuda:{self.device}): "
                    f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
            for e in entries:
                e.handle._set_exception(err)
            if self._broken is None:
                self._broken = err
                self.abort()
            raise err
        finally:
            if self._zero_ids:
                self._zero_ids.clear()

    def _follow(self, stream: int) -> None:
        """Makes `stream` wait for the communicator's latest op if that was launched on another
        stream, before an op is launched on `stream`."""
        tail, self._tail = self._tail, stream
        if tail is None:
            return
        done = self._last_done
        if tail == self._sp and type(done) is _Completion:
            ev = done.event.ptr  # recorded right after the engine stream's latest op
        else:
            # A caller's stream; or the engine's stream whose op failed before its launch
            # (`_OpError`) after waiting on this event: either way, what it stands for.
            ev = self._caller_done
        if ev is not None:
            _rt.streamWaitEvent(stream, ev, 0)

    def _caller_stream_ok(self, label: str, e: Entry, args: tuple) -> bool:
        """Whether a synchronous op can run on its caller's stream: an allreduce without
        scaling kernels (they run on the engine's stream) or a broadcast, writing a given
        output or one from the adapter's allocator (CuPy's pool allocates per stream)."""
        if id(e.tensor) in self._zero_ids or (
                e.output is None and (e.allocate is None or e.allocate is default_allocate)):
            return False
        if label == "broadcast":
            return True
        if label != "allreduce":
            return False
        resp = args[0]
        _, _, pre, post = self._reduction(resp.dtype, resp)
        return pre == 1.0 and post == 1.0

    def _on_caller_stream(self, stream: int, fn: Callable[..., None], entries: list[Entry],
                          args: tuple) -> None:
        """Runs a synchronous op on its caller's stream (an `OnStream` marker): the tensor is
        ready in that stream's order and the caller orders itself after the op there anyway, so
        neither a ready event nor a stream wait is needed, and one event after the op stands
        for its completion (cheaper on the host than the engine stream's path). Outputs are
        allocated on that stream."""
        keep = self._caller_inflight
        if len(keep) >= _REAP_AT and _rt.eventQuery(self._caller_done) == 0:
            keep.clear()  # the latest is done, so are the others (the ops are in order)
        if self._tail != stream:
            self._follow(stream)
        sp = self._sp
        self._sp = stream
        try:
            fn(entries, *args)
        finally:
            self._sp = sp
        # One event after the op, for whatever runs elsewhere later (`_follow`, a wait from
        # another stream): nothing is recorded on the caller's stream afterwards, which may be
        # gone by then.
        ev = self._caller_done
        if ev is None:
            ev = self._caller_done = int(_rt.eventCreateWithFlags(_DISABLE_TIMING))
        _rt.eventRecord(ev, stream)
        keep.append(entries)
        self._last_done = _StreamDone(stream, self.device, ev)

    def _other_device(self, e: Entry) -> HorovodInternalError:
        """The error for an op whose tensor is not on the device this process set's
        communicator was bound to. It ends the job: a peer may have launched its half of the
        op already, so the communicator cannot go on in step."""
        return HorovodInternalError(
            f"tensor {e.name} on rank {self.rank} is on cuda:{e.device}, but this rank's NCCL "
            f"communicator for ranks {self.control.global_ranks} is bound to "
            f"cuda:{self.device} (the device of its first GPU op); ringvod runs every GPU op "
            f"of a process set on one device per rank. Keep this rank's tensors on "
            f"cuda:{self.device}, e.g. call torch.cuda.set_device(hvd.local_rank()) once at "
            "start and place tensors with .cuda().")

    def _reap(self) -> None:
        q = self._inflight
        free = self._free_events
        # One stream runs the ops in order: when the newest is done, all are (one query
        # instead of one per op).
        if q and q[-1][0].done:
            while q:
                ev = q.popleft()[0]
                if len(free) < _FREE_EVENTS:
                    free.append(ev)
            return
        while q and q[0][0].done:
            ev = q.popleft()[0]
            if len(free) < _FREE_EVENTS:
                free.append(ev)

    def _out_ptr(self, e: Entry, shape: tuple[int, ...]) -> int:
        out = e.output
        if out is None:
            out = e.output = self._allocate(e, shape)
            self._allocated.add(id(e))
        return pointer_of(out)[0]

    def _allocate(self, e: Entry, shape: tuple[int, ...]) -> Any:
        alloc = e.allocate
        if alloc is None or alloc is default_allocate:
            self._use()
            return cupy.empty(shape, dtype=numpy_dtype(e.request.dtype))
        set_allocation_stream(self._sp)
        try:
            return alloc(shape, e.tensor)
        finally:
            set_allocation_stream(0)

    def _fusion_buffer(self, nbytes: int, like: Entry) -> int:
        """The fusion buffer's address, at least `nbytes` long. It grows by powers of two up to
        the fusion threshold (at least 1 MiB), so a job whose fused ops pack little keeps a
        small buffer: large members are reduced where they lie and never need it."""
        if nbytes > self._fusion_bytes:
            want = max(nbytes, min(1 << (nbytes - 1).bit_length(), self.fusion_threshold))
            want = (max(want, 1 << 20) + (1 << 20) - 1) >> 20 << 20
            item = like.request.dtype.itemsize
            if self._fusion_obj is not None:
                # Ops in flight may still read or write it, and not every framework's
                # allocator orders reuse on the engine's stream (TensorFlow's does not): it
                # stays referenced until the op being launched, later on this stream, is done.
                self._retired_buffers.append(self._fusion_obj)
            self._fusion_obj = self._allocate(like, (want // item,))
            self._fusion_ptr = pointer_of(self._fusion_obj)[0]
            self._fusion_bytes = want
        return self._fusion_ptr

    def _copies(self, pack: tuple[list[int], list[int], list[int]],
                unpack: tuple[list[int], list[int], list[int]] | None) -> Callable[[], None]:
        """Uploads both copy tables, launches the pack copies, returns a function for unpack."""
        if self._stager is None:
            assert self._kernels is not None
            self._stager = CopyStager(cupy, self._kernels, self.stream)
        self._use()  # the staging memory comes from CuPy's pool
        return self._stager.copies(pack, unpack)

    def _staged(self, entries: list[Entry], pack: tuple[list[int], list[int], list[int]],
                unpack: tuple[list[int], list[int], list[int]], name: str,
                collective: Callable[[], None]) -> None:
        """A fused op through the fusion buffer: the pack copies, `collective()` (the NCCL call,
        with a reduction's scaling kernels) and the unpack copies, each a timeline activity."""
        act = self._activity(entries, "MEMCPY_IN_FUSION_BUFFER")
        run_unpack = self._copies(pack, unpack)
        self._activity_end(act)
        act = self._activity(entries, name)
        collective()
        self._activity_end(act)
        act = self._activity(entries, "MEMCPY_OUT_FUSION_BUFFER")
        run_unpack()
        self._activity_end(act)

    def _activity(self, entries: list[Entry], name: str) -> list[str] | None:
        tl = self.timeline
        if tl is None:
            return None
        names = [e.name for e in entries]
        tl.activity_start_all(names, name)
        return names

    def _activity_end(self, names: list[str] | None) -> None:
        if names is not None:
            self.timeline.activity_end_all(names)

    def _reduction(self, dtype: DataType, resp: Response) -> tuple[int, int, float, float]:
        """(NCCL type, NCCL op, prescale, postscale) of a reduction, remembered per signature."""
        key = (dtype, resp.reduce_op, resp.prescale, resp.postscale)
        r = self._reductions.get(key)
        if r is None:
            r = self._reductions[key] = self._new_reduction(dtype, resp)
        return r

    def _new_reduction(self, dtype: DataType, resp: Response) -> tuple[int, int, float, float]:
        ntype = _NCCL_TYPE.get(dtype)
        if ntype is None:
            raise _OpError(UnsupportedOnGPUError(
                f"{dtype.label} tensors cannot be reduced on GPU (NCCL has no {dtype.label} "
                f"type); tensors {resp.names[:4]}: cast to int32 or a float type first"))
        op, pre, post = resp.reduce_op, resp.prescale, resp.postscale
        if dtype == DataType.BOOL:
            op = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        if op == ReduceOp.AVERAGE:
            if dtype.is_float and self._has_avg and pre == 1.0 and post == 1.0:
                return ntype, _AVG, 1.0, 1.0
            op, post = ReduceOp.SUM, post / self.size
        nop = _NCCL_OP.get(op)
        if nop is None:
            raise _OpError(UnsupportedOnGPUError(f"reduce op {op.name} is not supported on GPU"))
        if (pre != 1.0 or post != 1.0) and not Kernels.can_scale(dtype):
            raise _OpError(UnsupportedOnGPUError(
                f"{dtype.label} tensors cannot be scaled (prescale/postscale/Average); "
                f"tensors {resp.names[:4]}"))
        return ntype, nop, pre, post

    # -- ops ----------------------------------------------------------------------------------
    def allreduce(self, entries: list[Entry], response: Response) -> None:
        self._run("allreduce", self._allreduce, entries, response)

    def allgather(self, entries: list[Entry], response: Response) -> None:
        self._run("allgather", self._allgather, entries, response)

    def broadcast(self, entry: Entry, root: int) -> None:
        self._run("broadcast", self._broadcast, [entry], root)

    def alltoall(self, entry: Entry) -> None:
        self._run("alltoall", self._alltoall, [entry])

    def reducescatter(self, entries: list[Entry], response: Response) -> None:
        self._run("reducescatter", self._reducescatter, entries, response)

    def barrier(self) -> None:
        self.control.barrier()

    def _allreduce(self, entries: list[Entry], resp: Response) -> None:
        dt = resp.dtype
        ntype, op, pre, post = self._reduction(dt, resp)
        item = dt.itemsize
        comm, sp, kern = self.comm, self._sp, self._kernels
        assert kern is not None
        if len(entries) == 1:
            e = entries[0]
            src, nbytes = pointer_of(e.tensor)
            dst = self._out_ptr(e, e.request.shape)
            count = nbytes // item
            if count == 0:
                return
            if pre != 1.0:
                if dst != src:
                    _rt.memcpyAsync(dst, src, nbytes, _D2D, sp)
                kern.scale(dst, count, dt, pre)
                src = dst
            act = self._activity(entries, "NCCL_ALLREDUCE")
            comm.allReduce(src, dst, count, ntype, op, sp)
            self._activity_end(act)
            kern.scale(dst, count, dt, post)
            return
        # One pass: pointers, outputs, and the offsets of the members packed into the fusion
        # buffer, in their order; members of DIRECT_BYTES or more get an NCCL call of their own.
        srcs, dsts, sizes, offs = [], [], [], []
        direct: list[int] = []
        packed: list[int] = []
        limit = DIRECT_BYTES
        off = 0
        for e in entries:
            p, nb = pointer_of(e.tensor)
            if nb >= limit > 0:
                direct.append(len(srcs))
                offs.append(0)
            else:
                packed.append(len(srcs))
                offs.append(off)
                off += _pad16(nb)
            srcs.append(p)
            sizes.append(nb)
            dsts.append(self._out_ptr(e, e.request.shape))
        small = off  # the packed members' part of the buffer
        if direct:
            if _disjoint(srcs, dsts, sizes):
                self._grouped(entries, direct, packed, srcs, dsts, sizes, offs, small, dt,
                              (ntype, op, pre, post))
                return
            # Members of DIRECT_BYTES or more that share memory on this rank (the same tensor
            # twice, overlapping views) are packed too, after the others, but the NCCL calls
            # stay those of `_grouped`, which the other ranks may be making (their members
            # need not overlap, e.g. a joined rank's zeros): each large one, then the rest.
            for i in direct:
                offs[i] = off
                off += _pad16(sizes[i])
        if off == 0:
            return
        buf = self._fusion_buffer(off, entries[0])
        fused = [buf + o for o in offs]
        count = off // item
        calls = [(fused[i], fused[i], sizes[i] // item) for i in direct]
        if small:
            calls.append((buf, buf, small // item))

        def reduce() -> None:
            kern.scale(buf, count, dt, pre)
            self._nccl_group(calls, ntype, op)
            kern.scale(buf, count, dt, post)
        self._staged(entries, (srcs, fused, sizes), (fused, dsts, sizes), "NCCL_ALLREDUCE",
                     reduce)

    def _nccl_group(self, calls: list[tuple[int, int, int]], ntype: int, op: int) -> None:
        """In-place or out-of-place allreduces (source, destination, count) on the engine's
        stream, in one NCCL group when there are several."""
        comm, sp = self.comm, self._sp
        if len(calls) == 1:
            src, dst, count = calls[0]
            comm.allReduce(src, dst, count, ntype, op, sp)
            return
        nccl.groupStart()
        try:
            for src, dst, count in calls:
                comm.allReduce(src, dst, count, ntype, op, sp)
        except BaseException:
            try:
                nccl.groupEnd()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        nccl.groupEnd()

    def _grouped(self, entries: list[Entry], direct: list[int], packed: list[int],
                 srcs: list[int], dsts: list[int], sizes: list[int], offs: list[int],
                 small: int, dt: DataType, reduction: tuple[int, int, float, float]) -> None:
        """A fused allreduce whose `direct` members are reduced where they lie (or into their
        outputs), each by an NCCL call of its own, and the `packed` others through the fusion
        buffer (`small` bytes of it, member i at `offs[i]`), all in one NCCL group (one launch):
        the large members skip the two copies through the buffer. The members' memory does not
        overlap (`_disjoint`)."""
        kern, sp, item = self._kernels, self._sp, dt.itemsize
        assert kern is not None
        ntype, op, pre, post = reduction
        buf = count = 0
        run_unpack = None
        members: list[Entry] = []
        if small:
            members = [entries[i] for i in packed]
            buf = self._fusion_buffer(small, entries[0])
            fused = [buf + offs[i] for i in packed]
            psizes = [sizes[i] for i in packed]
            act = self._activity(members, "MEMCPY_IN_FUSION_BUFFER")
            run_unpack = self._copies(([srcs[i] for i in packed], fused, psizes),
                                      (fused, [dsts[i] for i in packed], psizes))
            self._activity_end(act)
            count = small // item
        act = self._activity(entries, "NCCL_ALLREDUCE")
        if pre != 1.0:
            for i in direct:
                if dsts[i] != srcs[i]:
                    _rt.memcpyAsync(dsts[i], srcs[i], sizes[i], _D2D, sp)
                kern.scale(dsts[i], sizes[i] // item, dt, pre)
            kern.scale(buf, count, dt, pre)
        src_of = dsts if pre != 1.0 else srcs  # prescaled members were copied to their outputs
        calls = [(src_of[i], dsts[i], sizes[i] // item) for i in direct]
        if count:
            calls.append((buf, buf, count))
        self._nccl_group(calls, ntype, op)
        if post != 1.0:
            for i in direct:
                kern.scale(dsts[i], sizes[i] // item, dt, post)
            kern.scale(buf, count, dt, post)
        self._activity_end(act)
        if run_unpack is not None:
            act = self._activity(members, "MEMCPY_OUT_FUSION_BUFFER")
            run_unpack()
            self._activity_end(act)

    def _broadcast(self, entries: list[Entry], root: int) -> None:
        e = entries[0]
        src, nbytes = pointer_of(e.tensor)
        dst = self._out_ptr(e, e.request.shape)
        if nbytes:
            act = self._activity(entries, "NCCL_BCAST")
            self.comm.broadcast(src, dst, nbytes, _UINT8, root, self._sp)
            self._activity_end(act)

    def _allgather(self, entries: list[Entry], resp: Response) -> None:
        _layouts.allgather(self, entries, resp)

    def _alltoall(self, entries: list[Entry]) -> None:
        _layouts.alltoall(self, entries)

    def _reducescatter(self, entries: list[Entry], resp: Response) -> None:
        _layouts.reducescatter(self, entries, resp)

    # -- results, zeros, lifecycle ------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype: DataType, device: int) -> Any:
        """Zeros for a joined rank, on this engine's device; on `device` (the one the rank
        named at its join, -1: the current one) when they are its first device work."""
        self._ensure_device(device)
        self._use()
        z = cupy.zeros(shape, dtype=numpy_dtype(dtype))
        self._zero_ids.add(id(z))
        return z

    def finish(self, entry: Entry) -> Any:
        return DeviceResult(entry.output, self._last_done, entry.result_kind,
                            entry.received_splits, allocated=id(entry) in self._allocated)

    def supports(self, dtype: DataType, op: ReduceOp | None = None) -> bool:
        return op is None or dtype in _NCCL_TYPE

    def guest_enter(self) -> None:
        guest_enter()

    def guest_exit(self) -> None:
        guest_exit()

    def abort(self) -> None:
        """ncclCommAbort: kernels waiting on a dead peer return; the engine is unusable after."""
        comm, self.comm = self.comm, None
        if self._broken is None:
            self._broken = HorovodInternalError(
                f"the NCCL communicator of ranks {self.control.global_ranks} was aborted")
        if comm is not None:
            _abort_comm(comm, self.device)
        self._forget()

    def _forget(self) -> None:
        """Drops the in-flight ops' entries and the caller-stream event (CUDA frees a pending
        event's resources once it fires)."""
        self._inflight.clear()
        self._caller_inflight.clear()
        self._retired_buffers.clear()
        ev, self._caller_done = self._caller_done, None
        if ev is not None:
            try:
                _on_device(self.device, _rt.eventDestroy, ev)
            except Exception:  # noqa: BLE001 - best effort (the context may be gone)
                pass

    def close(self) -> None:
        """Destroys the communicator once the stream drained; aborts it after CLOSE_TIMEOUT."""
        comm = self.comm
        if comm is None:
            self._forget()
            return
        if self._tail is not None and self._tail != self._sp and self._broken is None:
            self._follow(self._sp)  # drain what ran on a caller's stream too
        if not _drain(self.stream, self.device, f"ranks {self.control.global_ranks}"):
            self.abort()
            return
        with cupy.cuda.Device(self.device):
            self.comm = None
            self._forget()
            self._fusion_obj = None
            try:
                comm.destroy()
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                _log_.warning("ncclCommDestroy failed: %s", exc)


def create_engine(control: ControlPlane, config: Any) -> NCCLEngine:
    """The "nccl" engine factory (collective/engines/__init__.py).

    Raises:
        EngineUnavailableError: CuPy is installed but cannot load NCCL.
    """
    if not getattr(nccl, "available", True):
        raise EngineUnavailableError(
            "CuPy cannot load the NCCL library; install it with `pip install nvidia-nccl-cu12` "
            "(CUDA 12) or `pip install nvidia-nccl-cu13` (CUDA 13)")
    return NCCLEngine(control, config)


def _setup_info(data: bytes, rank: int) -> tuple:
    """(ok, why, host, device, bus) of one rank's engine setup, checked field by field."""
    try:
        v = json.loads(data)
        ok, why, host, dev, bus = v
        if not (type(ok) is bool and isinstance(why, str) and isinstance(host, str)
                and type(dev) is int and isinstance(bus, str)):
            raise ValueError("wrong field types")
    except (ValueError, TypeError, RecursionError) as exc:
        raise HorovodInternalError(
            f"rank {rank} sent a malformed NCCL setup message ({exc})") from None
    return ok, why, host, dev, bus
