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
import os
import pstats
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import frameworks.torch as hvd


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
        fn(200)  # warm-up: caches, communicators
        per = []
        for _ in range(5):
            sync()
            hvd.barrier()
            t = time.perf_counter()
            fn(a.iters // 5)
            sync()
            per.append((time.perf_counter() - t) / (a.iters // 5) * 1e6)
        rows.append((label, statistics.median(per)))
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
            fn(200)
            per = []
            for _ in range(5):
                sync()
                dist.barrier()
                t = time.perf_counter()
                fn(a.iters // 5)
                sync()
                per.append((time.perf_counter() - t) / (a.iters // 5) * 1e6)
            rows.append(("torch." + label, statistics.median(per)))
        dist.destroy_process_group()
    if rank == 0:
        for label, us in rows:
            print(f"PROFILE_OPS {label} bytes={a.bytes} us_per_op={us:.1f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
