"""Host cost of the pieces of a device op, one process (`python benchmarks/enqueue_micro.py`).

Times, in µs per call (median of 5 blocks of 2000): CUDA event creation and recording through
torch and CuPy, the current-stream lookup, the torch adapter's argument conversion, the whole
`allreduce_async_` enqueue, and the CuPy/NCCL calls the engine makes per op.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def per_call(fn, n=2000, blocks=5):
    out = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def main() -> int:
    import cupy
    from cupy.cuda import nccl

    import frameworks.torch as hvd
    from frameworks.torch import _buffers, _cuda
    hvd.init()
    torch.cuda.set_device(0)
    x = torch.ones(1024, device="cuda")
    s = torch.cuda.current_stream()
    rows = []

    def add(label, fn, **kw):
        rows.append((label, per_call(fn, **kw)))
    add("torch.cuda.current_stream(0)", lambda: torch.cuda.current_stream(0))
    add("_cuda._current_stream(0) (raw)", lambda: _cuda._current_stream(0))
    add("torch.cuda.Event()", lambda: torch.cuda.Event())
    add("torch.cuda.Event() + record(stream)", lambda: torch.cuda.Event().record(s))
    add("x.get_device()", lambda: x.get_device())
    add("x.data_ptr()+numel+element_size", lambda: (x.data_ptr(), x.numel(), x.element_size()))
    add("_buffers.to_collective(x, x)", lambda: _buffers.to_collective(x, x))
    stream = cupy.cuda.Stream(non_blocking=True)
    add("cupy.cuda.Event()", lambda: cupy.cuda.Event(block=False, disable_timing=True))
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    add("cupy event.record(stream)", lambda: ev.record(stream))
    add("cupy event.done", lambda: ev.done)
    rt = cupy.cuda.runtime
    tev = torch.cuda.Event()
    tev.record(s)
    add("runtime.streamWaitEvent", lambda: rt.streamWaitEvent(stream.ptr, tev.cuda_event, 0))
    raw = rt.eventCreateWithFlags(2)
    sp = stream.ptr
    add("runtime.eventRecord (raw event)", lambda: rt.eventRecord(raw, sp))
    add("runtime.getDevice", rt.getDevice)
    add("cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream)
    add("cupy stream.use()", stream.use)
    cupy.cuda.Stream.null.use()
    from collective.engines import device, nccl as _engine  # noqa: F401 - installs the pool
    add("device.record_ready (pooled raw event)",
        lambda: _engine._ready.release(device.record_ready(0, sp)))
    from collective.engines.nccl import _new_communicator, _uid_bytes
    comm = _new_communicator(1, _uid_bytes(nccl.get_unique_id()), 0)
    p = x.data_ptr()
    add("comm.allReduce (1 rank, 4 KiB)", lambda: comm.allReduce(p, p, 1024, 7, 0, stream.ptr),
        n=500)
    chk = getattr(comm, "check_async_error", None)
    if chk:
        add("comm.check_async_error()", chk)
    torch.cuda.synchronize()
    n = 2000
    hs = []
    t = time.perf_counter()
    for i in range(n):
        hs.append(hvd.allreduce_async_(x, op=hvd.Sum, name=f"m{i}"))
    enq = (time.perf_counter() - t) / n * 1e6
    for h in hs:
        hvd.synchronize(h)
    rows.append(("hvd.allreduce_async_ enqueue (coordinator busy)", enq))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(500):
        hvd.allreduce_(x, op=hvd.Sum, name="one")
    rows.append(("hvd.allreduce_ at size 1", (time.perf_counter() - t) / 500 * 1e6))
    comm.destroy()
    print("host cost per call, us:")
    for label, v in rows:
        print(f"  {label:48s} {v:8.2f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
