"""GPU allreduce latency and bus bandwidth: ringvod vs raw CuPy NCCL vs torch.distributed.

All three run in the same processes, on the same tensors, one after the other, so the numbers
compare like with like. Launch one process per GPU, e.g.::

    mpirun --allow-run-as-root --bind-to none -np 2 -x NCCL_NVLS_ENABLE=0 \
        python benchmarks/gpu_allreduce.py --json out/allreduce.json

Measures, per size (float32, Sum, in place):

* in flight: a pool of up to 64 distinct tensors (at most 1 GiB in all, at least 2) is reduced
  op after op without waiting, then every op is waited for, and the pool again until the block
  has `iters` ops; then one device synchronize (nccl-tests' method). For ringvod each op is
  `allreduce_async_` with its own name and the waits are `synchronize(handle)` (which only
  orders the stream), so the ops in flight are negotiated together and fused, as gradients
  are; torch.distributed and raw CuPy NCCL launch them one by one.
  busbw = bytes / time × 2(n−1)/n. Each timed block lasts ≥ ~20 ms of GPU time (at least 20
  ops), so the first op's host latency is not counted as bandwidth;
  the three series alternate for `--rounds` rounds and each reports its median block;
* dependent (ringvod only): `synchronize(allreduce_async_(x))` on one tensor, op after op,
  each waited for before the next is submitted: one negotiation and thread hand-off per op,
  the per-op host cost without fusion or overlap;
* with `--eager-ab`: more ringvod in-flight series, each with `collective.ops.EAGER_BYTES` set
  to a value (0 turns the large-op rule off; a trailing `d` launches through a driven cycle
  instead of the express lane), alternating with the others; `--direct-ab` does the same for
  the NCCL engine's `DIRECT_BYTES`;
* lone: one synchronous op (`hvd.allreduce_`, `dist.all_reduce`) followed by a host wait for
  the GPU, repeated; the median (what a program that needs the value at once sees).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import frameworks.torch as hvd  # noqa: E402
from _report import busbw, format_table, human_bytes, write_results  # noqa: E402

SIZES = [1 << k for k in (10, 12, 14, 17, 20, 22, 24, 26, 28, 30)]


def timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def lone(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 5):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--min-bytes", type=int, default=0)
    p.add_argument("--sizes", default="", help="comma list of sizes in bytes instead of the "
                   "default series")
    p.add_argument("--lone-sizes", default="1024,65536,1048576")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size")
    p.add_argument("--eager-ab", default="", help="A/B: extra ringvod in-flight series with "
                   "collective.ops.EAGER_BYTES set to each of these values (0 = off)")
    p.add_argument("--stream-ab", action="store_true", help="A/B: a second ringvod lone series "
                   "with synchronous ops on the engine's stream behind a ready event "
                   "(collective.engines.device.CALLER_STREAM off) instead of the caller's")
    p.add_argument("--direct-ab", default="", help="A/B: extra ringvod in-flight series with "
                   "the NCCL engine's DIRECT_BYTES set to each of these values (0 = every "
                   "member of a fused allreduce through the fusion buffer)")
    a = p.parse_args()
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=n)
    import cupy
    from cupy.cuda import nccl

    from collective.engines.nccl.comm import _new_communicator, _uid_bytes, versions
    uid = hvd.broadcast_object(_uid_bytes(nccl.get_unique_id()) if rank == 0 else None, 0)
    cupy.cuda.Device(torch.cuda.current_device()).use()
    comm = _new_communicator(n, uid, rank)
    cstream = cupy.cuda.Stream(non_blocking=True)
    rows, lone_rows = [], []

    def ringvod_dependent(x):
        # One name per size, as a training loop reuses its names (the negotiation cache path).
        hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name=f"bw.{x.numel()}"))

    def ringvod_block(pool, names):
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm) for t, nm in zip(pool, names)]
        for h in hs:
            hvd.synchronize(h)

    def each(fn):
        def block(pool, _names):
            for t in pool:
                fn(t)
        return block

    def ringvod_sync(x):  # the synchronous API: hvd.allreduce_ returns when x can be used
        hvd.allreduce_(x, op=hvd.Sum, name=f"bw.{x.numel()}")

    from collective.engines import device as cdevice

    def engine_stream_sync(x):
        cdevice.CALLER_STREAM = False
        try:
            ringvod_sync(x)
        finally:
            cdevice.CALLER_STREAM = True

    def torchdist(x):
        dist.all_reduce(x)

    def raw(x):
        comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cstream.ptr)

    def raw_sync(x):
        raw(x)
        cstream.synchronize()

    import collective.ops as cops
    default_eager, start_now = cops.EAGER_BYTES, cops._start_now

    def drive_only(rt, state, e):
        rt.submit(state, [e], wake=False)
        rt.coordinator.drive()

    def with_eager(v):  # "N": EAGER_BYTES = N; "Nd": and a driven cycle without the express lane
        def block(pool, names):
            cops.EAGER_BYTES = int(v.rstrip("d"))
            if v.endswith("d"):
                cops._start_now = drive_only
            try:
                ringvod_block(pool, names)
            finally:
                cops.EAGER_BYTES, cops._start_now = default_eager, start_now
        return block

    impls = [("ringvod", ringvod_block), ("CuPy NCCL", each(raw)),
             ("torch.distributed", each(torchdist))]
    from collective.engines.nccl import engine as cengine
    default_direct = cengine.DIRECT_BYTES

    def with_direct(v):
        def block(pool, names):
            cengine.DIRECT_BYTES = int(v)
            try:
                ringvod_block(pool, names)
            finally:
                cengine.DIRECT_BYTES = default_direct
        return block

    impls += [(f"ringvod eager={v}", with_eager(v)) for v in a.eager_ab.split(",") if v]
    impls += [(f"ringvod direct={v}", with_direct(v)) for v in a.direct_ab.split(",") if v]
    sizes = [int(x) for x in a.sizes.split(",") if x] or SIZES
    for nb in [s for s in sizes if a.min_bytes <= s <= a.max_bytes]:
        # ~20 ms of GPU time per block at ~300 GB/s (at least 20 ops, at most 200).
        iters = min(max(20, int(20e-3 * 300e9 / 2 / max(nb, 1))), 200)
        if a.quick:
            iters = max(iters // 4, 5)
        depth = max(2, min(64, (1 << 30) // nb, iters))
        pool = [torch.ones(nb // 4, device="cuda") for _ in range(depth)]
        names = [f"bw.{nb}.{i}" for i in range(depth)]
        reps = -(-iters // depth)  # blocks of the pool per timed block
        ops = reps * depth
        times: dict[str, list[float]] = {label: [] for label, _ in impls}
        dep: list[float] = []
        for _ in range(max(a.rounds, 1)):
            for label, fn in impls:
                if label == "CuPy NCCL":
                    torch.cuda.synchronize()
                times[label].append(timed(lambda: fn(pool, names), reps, 2) / depth)
                if label == "CuPy NCCL":
                    cstream.synchronize()
            dep.append(timed(lambda: ringvod_dependent(pool[0]), iters, 5))
        rows.append({"series": "ringvod dependent", "bytes": nb, "time_us":
                     statistics.median(dep) * 1e6, "iters": iters,
                     "rounds_us": [v * 1e6 for v in dep],
                     "busbw_gbs": busbw(nb, statistics.median(dep), n)})
        for label, _ in impls:
            t = statistics.median(times[label])
            rows.append({"series": label, "bytes": nb, "time_us": t * 1e6, "iters": ops,
                         "depth": depth, "rounds_us": [v * 1e6 for v in times[label]],
                         "busbw_gbs": busbw(nb, t, n)})
        pool.clear()
    for nb in [int(s) for s in a.lone_sizes.split(",") if s]:
        x = torch.ones(nb // 4, device="cuda")
        iters = 100 if a.quick else 300
        series = [("ringvod", ringvod_sync), ("CuPy NCCL", raw_sync),
                  ("torch.distributed", torchdist)]
        if a.stream_ab:
            series.append(("ringvod engine stream", engine_stream_sync))
        for label, fn in series:
            t = lone(lambda: fn(x), iters)
            lone_rows.append({"series": label, "bytes": nb, "lone_us": t * 1e6})
    if rank == 0:
        table = []
        for nb in sorted({r["bytes"] for r in rows}):
            by = {r["series"]: r for r in rows if r["bytes"] == nb}
            rv, cp, td = by["ringvod"], by["CuPy NCCL"], by["torch.distributed"]
            dp = by["ringvod dependent"]
            table.append([human_bytes(nb), rv["depth"], f"{rv['time_us']:.1f}",
                          f"{rv['busbw_gbs']:.1f}", f"{cp['time_us']:.1f}",
                          f"{cp['busbw_gbs']:.1f}", f"{td['time_us']:.1f}",
                          f"{td['busbw_gbs']:.1f}",
                          f"{rv['busbw_gbs'] / cp['busbw_gbs'] * 100:.0f}%",
                          f"{rv['busbw_gbs'] / td['busbw_gbs']:.2f}x", f"{dp['time_us']:.1f}"])
        print(f"allreduce float32, {n} GPUs ({torch.cuda.get_device_name()}), {versions()}")
        print("ops in flight (us per op, median block; ringvod fuses the ops in flight), and "
              "ringvod's dependent ops (each waited for before the next):")
        print(format_table(["size", "in flight", "ringvod us", "busbw", "cupy us", "busbw",
                            "torch us", "busbw", "rv/raw", "rv/torch", "dependent us"], table))
        for label, _ in impls[3:]:
            vt = []
            for nb in sorted({r["bytes"] for r in rows}):
                by = {r["series"]: r for r in rows if r["bytes"] == nb}
                rv, td, base = by[label], by["torch.distributed"], by["ringvod"]
                vt.append([human_bytes(nb), f"{rv['time_us']:.1f}", f"{base['time_us']:.1f}",
                           f"{td['time_us']:.1f}", f"{rv['busbw_gbs'] / td['busbw_gbs']:.2f}x",
                           f"{base['busbw_gbs'] / td['busbw_gbs']:.2f}x",
                           " ".join(f"{v:.0f}" for v in rv["rounds_us"]),
                           " ".join(f"{v:.0f}" for v in base["rounds_us"])])
            print(f"A/B in flight: {label} against ringvod (EAGER_BYTES={default_eager}, "
                  f"DIRECT_BYTES={default_direct}):")
            print(format_table(["size", "variant us", "ringvod us", "torch us", "var/torch",
                                "rv/torch", "variant rounds", "ringvod rounds"], vt))
        lt = []
        for nb in sorted({r["bytes"] for r in lone_rows}):
            by = {r["series"]: r["lone_us"] for r in lone_rows if r["bytes"] == nb}
            lt.append([human_bytes(nb), f"{by['ringvod']:.1f}", f"{by['CuPy NCCL']:.1f}",
                       f"{by['torch.distributed']:.1f}",
                       f"{by['ringvod'] / by['torch.distributed']:.2f}x"]
                      + ([f"{by['ringvod engine stream']:.1f}",
                          f"{by['ringvod engine stream'] / by['torch.distributed']:.2f}x"]
                         if a.stream_ab else []))
        from collective import _current as runtime
        coord = runtime.current().coordinator
        print("lone synchronous allreduce (median, host waits for the GPU; express rounds "
              f"{coord.express_rounds}, of which waited {coord.express_waits}):")
        print(format_table(["size", "ringvod us", "cupy us", "torch us", "rv/torch"]
                           + (["engine-stream us", "es/torch"] if a.stream_ab else []), lt))
        if a.json:
            write_results(a.json, "gpu_allreduce", {"pipelined": rows, "lone": lone_rows},
                          params={"gpus": n, "device": torch.cuda.get_device_name(),
                                  "versions": versions(), "torch": torch.__version__})
        if a.png:
            try:
                from _report import plot_bandwidth
                plot_bandwidth(rows, a.png, title=f"allreduce float32, {n}x "
                               f"{torch.cuda.get_device_name()}")
            except Exception as exc:  # noqa: BLE001 - the table is the result
                print(f"plot failed: {exc}")
    dist.destroy_process_group()
    comm.destroy()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
