"""Where the host time of small GPU allreduces goes: cProfile of three loops on rank 0.

* `lone`: `hvd.allreduce_(x)` then a device synchronize, repeated (the express lane);
* `dependent`: `synchronize(allreduce_async_(x))` repeated, each op waited for before the next
  is submitted (one negotiation per op, on the coordinator thread);
* `inflight`: `--depth` ops on distinct tensors submitted, then all synchronized.

Each loop is timed without the profiler first (median µs per op), then profiled; rank 0 prints
the top functions by own time. From Python 3.12 cProfile sees every thread (the coordinator's
cycles included); before, only the calling thread.

    mpirun -np 2 python tools/profile_ops.py [--bytes 65536] [--iters 2000] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import _common  # noqa: F401 - NVLS off, the repository root on sys.path
import torch

import frameworks.torch as hvd


def time_loop(fn: Callable[[int], None], iters: int, sync: Callable[[], None],
              barrier: Callable[[], object]) -> float:
    """Median µs per op of `fn(k)` (k ops) over 5 timed windows of `iters // 5` ops each,
    after a warm-up of 200 ops (caches, communicators); every window starts synchronized
    (`sync`, then `barrier` across the ranks) and ends with `sync`."""
    fn(200)
    k = iters // 5
    per = []
    for _ in range(5):
        sync()
        barrier()
        t = time.perf_counter()
        fn(k)
        sync()
        per.append((time.perf_counter() - t) / k * 1e6)
    return statistics.median(per)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=65536)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--loops", default="lone,dependent,inflight")
    p.add_argument("--port", type=int, default=29547)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    hvd.init()
    rank = hvd.rank()
    if a.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device(a.device)
    n = max(a.bytes // 4, 1)
    x = torch.ones(n, device=dev)
    pool = [torch.ones(n, device=dev) for _ in range(a.depth)]
    names = [f"prof.{i}" for i in range(a.depth)]

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    def lone(k: int) -> None:
        for _ in range(k):
            hvd.allreduce_(x, op=hvd.Sum, name="prof.lone")
            sync()

    def dependent(k: int) -> None:
        for _ in range(k):
            hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name="prof.dep"))
        sync()

    def inflight(k: int) -> None:
        for _ in range(max(k // a.depth, 1)):
            hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm) for t, nm in zip(pool, names)]
            for h in hs:
                hvd.synchronize(h)
        sync()

    rows = []
    for label in a.loops.split(","):
        fn = {"lone": lone, "dependent": dependent, "inflight": inflight}[label]
        rows.append((label, time_loop(fn, a.iters, sync, hvd.barrier)))
        if rank == 0:
            print(f"PROFILE_OPS {label} bytes={a.bytes} us_per_op={rows[-1][1]:.1f}", flush=True)
        hvd.barrier()
        prof = cProfile.Profile()
        prof.enable()
        fn(a.iters)
        prof.disable()
        hvd.barrier()
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            print(f"==== {label}: {a.iters} ops of {a.bytes} B\n{s.getvalue()}", flush=True)
    if a.device == "cuda":  # the same loops with torch.distributed, for scale
        import torch.distributed as dist
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                                world_size=hvd.size())

        def t_lone(k):
            for _ in range(k):
                dist.all_reduce(x)
                sync()

        def t_dep(k):
            for _ in range(k):
                dist.all_reduce(x, async_op=True).wait()
            sync()

        def t_inflight(k):
            for _ in range(max(k // a.depth, 1)):
                ws = [dist.all_reduce(t, async_op=True) for t in pool]
                for w in ws:
                    w.wait()
            sync()
        for label, fn in (("lone", t_lone), ("dependent", t_dep), ("inflight", t_inflight)):
            rows.append(("torch." + label, time_loop(fn, a.iters, sync, dist.barrier)))
        dist.destroy_process_group()
    if rank == 0:
        for label, us in rows:
            print(f"PROFILE_OPS {label} bytes={a.bytes} us_per_op={us:.1f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
