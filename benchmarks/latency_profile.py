"""cProfile of a lone synchronous allreduce loop: the calling thread and the coordinator thread
profiled separately (rank 0 prints both, top functions by own time). Diagnostic only; cProfile
inflates small functions, so read the ranking, not the absolute times.

    mpirun -np 2 python benchmarks/latency_profile.py [--device cuda] [--iters 2000]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import collective.coordinator as coord_mod  # noqa: E402

_PROF = cProfile.Profile()
_orig_loop = coord_mod.Coordinator._loop


def _profiled_loop(self):
    _PROF.enable()
    try:
        _orig_loop(self)
    finally:
        _PROF.disable()


coord_mod.Coordinator._loop = _profiled_loop

import frameworks.torch as hvd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    hvd.init()
    if a.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    x = torch.ones(1024, device=a.device)
    for _ in range(50):
        hvd.allreduce_(x, op=hvd.Sum, name="p")
    sync()
    main_prof = cProfile.Profile()
    main_prof.enable()
    for _ in range(a.iters):
        hvd.allreduce_(x, op=hvd.Sum, name="p")
        sync()
    main_prof.disable()
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        for label, prof in (("calling thread", main_prof), ("coordinator thread", _PROF)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print(f"==== {label} ({a.device}, {a.iters} ops)")
            print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
