"""Where a block of device allreduces in flight loses time against torch.distributed.

The in-flight pattern of `benchmarks/gpu_allreduce.py` (a pool of distinct tensors, each
`allreduce_async_` without waiting, then `synchronize` each, then a device synchronize),
with timestamps on the coordinator's negotiation rounds and the NCCL engine's launches (it
wraps `Negotiator.round` and `NCCLEngine._run` by name; no code changes in the library).
Per size it prints the median over the timed blocks of:

* µs per op of the whole block, ringvod and torch.distributed (same processes, alternating);
* submit: how long the caller's loop of `allreduce_async_` took (torch.distributed's loop
  launches as it goes, so its submit time is its launch time);
* first launch / last launch end: when the engine started the block's first NCCL launch and
  finished its last, from the start of the block (the GPU is idle before the first);
* launch: host time of one engine launch (a fused launch packs and unpacks its members);
* round: host time of one negotiation round, and rounds per block.

Launch one process per GPU::

    mpirun -np 2 python tools/inflight_probe.py [--sizes 1,4,8,16,64] [--blocks 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common  # noqa: F401 - NVLS off, the repository root on sys.path
import torch
import torch.distributed as dist

import frameworks.torch as hvd
from collective.coordinator import negotiate
from collective.engines.nccl import engine

_now = time.perf_counter
_spans: list[tuple[float, float, str]] = []  # (start, end, "launch" | "round")


def _timed(cls: type, name: str, kind: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t = _now()
        try:
            return inner(*args, **kwargs)
        finally:
            _spans.append((t, _now(), kind))
    setattr(cls, name, wrapper)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,4,8,16,64", help="MiB per tensor, comma list")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks per size")
    p.add_argument("--port", type=int, default=29611)
    a = p.parse_args()
    _timed(negotiate.Negotiator, "round", "round")
    _timed(engine.NCCLEngine, "_run", "launch")
    hvd.init()
    rank = hvd.rank()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=hvd.size())

    def ringvod_block(pool, names) -> dict[str, float]:
        _spans.clear()
        t0 = _now()
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm) for t, nm in zip(pool, names)]
        t1 = _now()
        for h in hs:
            hvd.synchronize(h)
        torch.cuda.synchronize()
        t2 = _now()
        launches = [s for s in _spans if s[2] == "launch"]
        rounds = [s for s in _spans if s[2] == "round" and s[0] >= t0]
        return {"op": (t2 - t0) / len(pool), "submit": t1 - t0,
                "first": launches[0][0] - t0 if launches else float("nan"),
                "last": launches[-1][1] - t0 if launches else float("nan"),
                "launch": statistics.fmean(e - s for s, e, _ in launches) if launches else 0.0,
                "round": statistics.fmean(e - s for s, e, _ in rounds) if rounds else 0.0,
                "rounds": len(rounds)}

    def torch_block(pool) -> dict[str, float]:
        t0 = _now()
        for t in pool:
            dist.all_reduce(t)
        t1 = _now()
        torch.cuda.synchronize()
        return {"op": (_now() - t0) / len(pool), "submit": t1 - t0}

    for mib in (float(s) for s in a.sizes.split(",") if s):
        nb = int(mib * (1 << 20))
        depth = max(2, min(50, (1 << 30) // nb))  # the sweep's pools: at most 1 GiB
        pool = [torch.ones(nb // 4, device="cuda") for _ in range(depth)]
        names = [f"probe.{nb}.{i}" for i in range(depth)]
        for _ in range(3):  # warm-up: cache entries, communicators, fusion buffer
            ringvod_block(pool, names)
            torch_block(pool)
        rv, td = [], []
        for _ in range(a.blocks):
            hvd.barrier()
            torch.cuda.synchronize()
            rv.append(ringvod_block(pool, names))
            hvd.barrier()
            torch.cuda.synchronize()
            td.append(torch_block(pool))
        if rank == 0:
            def med(rows, key, scale=1e6):  # seconds to µs
                return statistics.median(r[key] for r in rows) * scale
            print(f"{mib:g} MiB x {depth}: ringvod {med(rv, 'op'):.1f} us/op, torch.distributed "
                  f"{med(td, 'op'):.1f} us/op | submit {med(rv, 'submit'):.0f} us (torch "
                  f"{med(td, 'submit'):.0f}), first launch at {med(rv, 'first'):.0f} us, last "
                  f"launch ends {med(rv, 'last'):.0f} us, launch {med(rv, 'launch'):.1f} us, "
                  f"round {med(rv, 'round'):.1f} us x {med(rv, 'rounds', 1):g}", flush=True)
        pool.clear()
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
