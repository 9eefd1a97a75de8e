"""A lone synchronous allreduce in a tight loop, for a sampling profiler (py-spy) to attribute
the per-op host time; prints the median per-op time of blocks of 1000.

    mpirun -np 2 py-spy record -f raw -o prof.txt -- python benchmarks/lone_loop.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import frameworks.torch as hvd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20000)
    a = p.parse_args()
    hvd.init()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.ones(a.bytes // 4, device=a.device)
    blocks = []
    for _ in range(max(a.iters // 1000, 1)):
        t = time.perf_counter()
        for _ in range(1000):
            hvd.allreduce_(x, op=hvd.Sum, name="lone")
            sync()
        blocks.append((time.perf_counter() - t) / 1000 * 1e6)
    if hvd.rank() == 0:
        print(f"lone_loop size={hvd.size()} device={a.device} bytes={a.bytes}: median "
              f"{statistics.median(blocks):.1f} us per op (blocks of 1000; min "
              f"{min(blocks):.1f})", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
