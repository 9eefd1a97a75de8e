"""A lone synchronous allreduce in a loop, in a process that runs nothing else: ringvod
(`hvd.allreduce_`), torch.distributed (`dist.all_reduce`) or CuPy's bare NCCL call on the
current stream (`--impl cupy`, CUDA only, needs mpi4py), each followed by a host wait for the
device. Prints the median per-op time, the median time until the call returned (its host
cost) and the mean over blocks of 1000 ops. Also the target of a sampling profiler (py-spy)
for the per-op host time. `--impl ab` runs, in the same processes, alternating blocks of
ringvod on the caller's stream (the default), ringvod on its engine's stream
(`--engine-stream`'s path) and torch.distributed, and prints each one's median.

    mpirun -np 2 python tools/lone_loop.py --device cuda [--impl torch|cupy|ab]
    mpirun -np 2 py-spy record -f raw -o prof.txt -- python tools/lone_loop.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _common  # noqa: F401 - NVLS off, the repository root on sys.path
import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", choices=["ringvod", "torch", "cupy", "ab"], default="ringvod")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--tag", default="", help="label for the output line (e.g. an older tree)")
    p.add_argument("--engine-stream", action="store_true", help="A/B: ringvod runs the op on "
                   "its engine's stream behind a ready event, as asynchronous ops do, instead "
                   "of on the caller's stream (collective.engines.device.CALLER_STREAM off)")
    a = p.parse_args()
    cuda = a.device == "cuda"
    if a.impl == "cupy" and not cuda:
        p.error("--impl cupy needs --device cuda (NCCL reduces device memory)")
    if a.impl == "ab":
        return _ab(a)
    if a.impl == "ringvod":
        import frameworks.torch as hvd
        if a.engine_stream:
            from collective.engines import device
            device.CALLER_STREAM = False
            a.tag = a.tag or "engine-stream"
        hvd.init()
        rank, size, local = hvd.rank(), hvd.size(), hvd.local_rank()
    else:
        import torch.distributed as dist
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
        size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK",
                                                                               str(rank))))
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    x = torch.ones(a.bytes // 4, device=a.device)
    if a.impl == "ringvod":
        def op():
            hvd.allreduce_(x, op=hvd.Sum, name="lone")
    elif a.impl == "cupy":
        from cupy.cuda import nccl
        from mpi4py import MPI
        uid = MPI.COMM_WORLD.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
        comm = nccl.NcclCommunicator(size, uid, rank)
        ptr, count = x.data_ptr(), x.numel()
        stream = torch.cuda.current_stream().cuda_stream

        def op():
            comm.allReduce(ptr, ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream)
    else:
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                                world_size=size)

        def op():
            dist.all_reduce(x)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(200):
        op()
    sync()
    per_op, returned, blocks = [], [], []
    now = time.perf_counter
    for _ in range(max(a.iters // 1000, 1)):
        t0 = now()
        for _ in range(1000):
            t = now()
            op()
            t1 = now()
            sync()
            per_op.append(now() - t)
            returned.append(t1 - t)
        blocks.append((now() - t0) / 1000)
    if rank == 0:
        impl = a.impl + ("/" + a.tag if a.tag else "")
        print(f"lone_loop impl={impl} size={size} device={a.device} bytes={a.bytes}: median "
              f"{statistics.median(per_op) * 1e6:.1f} us per op (call returned after "
              f"{statistics.median(returned) * 1e6:.1f}), mean of 1000-op blocks "
              f"{statistics.median(blocks) * 1e6:.1f} us", flush=True)
    if a.impl == "ringvod":
        hvd.shutdown()
    elif a.impl == "torch":
        dist.destroy_process_group()
    return 0


def _ab(a: argparse.Namespace) -> int:
    """Alternating blocks of 500 ops: ringvod on the caller's stream, ringvod on the engine's
    stream, torch.distributed; medians per series over every op of its blocks."""
    import torch.distributed as dist

    import frameworks.torch as hvd
    from collective.engines import device
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=rank, world_size=size)
    x = torch.ones(a.bytes // 4, device=a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def ringvod() -> None:
        hvd.allreduce_(x, op=hvd.Sum, name="lone")

    series = {"ringvod caller stream": (True, ringvod), "ringvod engine stream": (False, ringvod),
              "torch.distributed": (True, lambda: dist.all_reduce(x))}
    per_op: dict[str, list[float]] = {k: [] for k in series}
    returned: dict[str, list[float]] = {k: [] for k in series}
    now = time.perf_counter
    for block in range(-1, max(a.iters // 1500, 1)):
        for label, (caller, op) in series.items():
            device.CALLER_STREAM = caller
            for _ in range(500):
                t = now()
                op()
                t1 = now()
                sync()
                if block >= 0:  # block -1 warms up
                    per_op[label].append(now() - t)
                    returned[label].append(t1 - t)
    device.CALLER_STREAM = True
    if rank == 0:
        base = statistics.median(per_op["torch.distributed"])
        for label in series:
            m = statistics.median(per_op[label])
            print(f"lone_loop ab size={size} device={a.device} bytes={a.bytes} {label}: median "
                  f"{m * 1e6:.1f} us per op (call returned after "
                  f"{statistics.median(returned[label]) * 1e6:.1f}), {m / base:.2f}x "
                  "torch.distributed", flush=True)
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
