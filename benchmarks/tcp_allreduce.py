"""Host allreduce: tcp mode vs MPI mode (both through `collective`) vs raw mpi4py.

Usage::

    python benchmarks/tcp_allreduce.py [--np 2] [--rounds 3] [--json out.json]

The driver runs every variant once per round, interleaved (so a noisy neighbour hits all of
them alike), and pools the per-op samples of all rounds:

* ``tcp``: ``hvdrun --gloo`` (tcp mode; same-host ranks stream through shared memory),
* ``tcp-sockets``: the same with shared memory off (Unix sockets between same-host ranks),
* ``mpi``: ``mpirun`` with `collective` in MPI mode,
* ``mpi4py``: ``mpirun`` with raw ``comm.Allreduce(IN_PLACE, ...)``.

Each op is timed alone after a barrier, in place (``allreduce_``, Sum, float32). Latency is
the median; bus bandwidth = bytes / median time x 2(n-1)/n. MPI runs set
``OMPI_MCA_mpi_yield_when_idle=1`` (without it latencies are bimodal
when ranks outnumber cores).

Ranks import ringvod from a copy named on `PYTHONPATH`, else this checkout (`_library.py`);
the `LIBRARY <folder>` line above the tables says which.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
VARIANTS = ("tcp", "tcp-sockets", "mpi", "mpi4py")


def _iters(nbytes: int, scale: float) -> int:
    return max(5, int(min(200, (256 << 20) // nbytes) * scale))


# -- worker ------------------------------------------------------------------------------------
def worker(kind: str, out: str, sizes: list[int], scale: float, shm: bool) -> None:
    import numpy as np
    samples: dict[int, list[float]] = {}
    if kind == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()

        def barrier() -> None:
            comm.Barrier()

        def run(a: np.ndarray, i: int) -> None:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    else:
        if not shm:
            from collective.engines.tcp import shm as tcp_shm
            tcp_shm.ENABLED = False
        import collective as hvd
        hvd.init()
        rank, n = hvd.rank(), hvd.size()

        def barrier() -> None:
            hvd.barrier()

        def run(a: np.ndarray, i: int) -> None:
            hvd.allreduce_(a, op=hvd.Sum, name=f"bench.{a.nbytes}")
    for nbytes in sizes:
        a = np.zeros(nbytes // 4, np.float32)
        for i in range(3):
            run(a, i)
        ts = []
        for i in range(_iters(nbytes, scale)):
            barrier()
            t0 = time.perf_counter()
            run(a, i)
            ts.append(time.perf_counter() - t0)
        samples[nbytes] = ts
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"np": n, "samples": {str(k): v for k, v in samples.items()}}, f)
    if kind != "mpi4py":
        hvd.shutdown()


# -- driver ------------------------------------------------------------------------------------
def _command(variant: str, np_: int, out: str, sizes: list[int], scale: float) -> list[str]:
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "mpi4py" if variant == "mpi4py" else "collective", "--out", out,
          "--sizes", ",".join(map(str, sizes)), "--scale", str(scale)]
    if variant == "tcp-sockets":
        me.append("--no-shm")
    if variant.startswith("tcp"):
        return [sys.executable, "-m", "launcher", "--gloo", "-np", str(np_), *me]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "-np", str(np_), "-x", "OMPI_MCA_mpi_yield_when_idle=1", "-x", "PYTHONPATH", *me]


def drive(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    pooled: dict[str, dict[int, list[float]]] = {v: {s: [] for s in sizes} for v in args.variants}
    env = dict(os.environ, PYTHONPATH=_library.pythonpath(), OMPI_MCA_mpi_yield_when_idle="1")
    for k in [k for k in env if k.startswith("HOROVOD_")]:
        del env[k]
    for rnd in range(args.rounds):
        for variant in args.variants:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = _command(variant, args.np, out, sizes, args.scale)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, env=env, cwd=_library.NO_LIBRARY, capture_output=True,
                                  text=True, timeout=args.timeout)
            if proc.returncode != 0:
                sys.exit(f"{variant} failed (rc {proc.returncode}):\n{proc.stdout}\n"
                         f"{proc.stderr}")
            with open(out) as f:
                res = json.load(f)
            os.unlink(out)
            for s in sizes:
                pooled[variant][s].extend(res["samples"][str(s)])
            print(f"round {rnd + 1}/{args.rounds}: {variant} done in "
                  f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    n = args.np
    table: dict[str, dict[str, dict[str, float]]] = {}
    for variant, by in pooled.items():
        table[variant] = {}
        for s, ts in by.items():
            med = statistics.median(ts)
            table[variant][str(s)] = {
                "median_s": med, "p10_s": sorted(ts)[len(ts) // 10], "samples": len(ts),
                "busbw_GBps": s / med * 2 * (n - 1) / n / 1e9}
    return {"benchmark": "tcp_allreduce", "np": n, "rounds": args.rounds,
            "date": datetime.date.today().isoformat(), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "library": _library.where(),
            "dtype": "float32", "op": "sum, in place", "results": table}


def _fmt_size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def print_table(res: dict, key: str = "median_s") -> None:
    """Markdown table of latency and busbw per size (key: median_s or p10_s)."""
    variants = list(res["results"])
    head = "| size | " + " | ".join(f"{v} lat (us) | {v} busbw (GB/s)" for v in variants)
    if "tcp" in variants and "mpi" in variants:
        head += " | tcp/mpi busbw"
    print(head + " |")
    print("|" + "---|" * (head.count("|") - 1))
    for s in res["results"][variants[0]]:
        cells = []
        for v in variants:
            r = res["results"][v][s]
            t = r[key]
            cells.append(f"{t * 1e6:.0f} | {int(s) / t * 2 * (res['np'] - 1) / res['np'] / 1e9:.2f}")
        line = f"| {_fmt_size(int(s))} | " + " | ".join(cells)
        if "tcp" in variants and "mpi" in variants:
            ratio = res["results"]["mpi"][s][key] / res["results"]["tcp"][s][key]
            line += f" | {ratio:.0%}"
        print(line + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=0.25, help="fraction of the default iterations")
    p.add_argument("--sizes", default="", help="comma list of bytes (default 4 KiB..64 MiB)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "tcp_allreduce.json"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", choices=["collective", "mpi4py"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--no-shm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
        worker(args.worker, args.out, sizes, args.scale, not args.no_shm)
        return
    res = drive(args)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"LIBRARY {res['library']}")
    print(f"# {res['date']} {res['host']} ({res['cpus']} CPUs), np={res['np']}, "
          f"{res['rounds']} interleaved rounds, medians of pooled samples")
    print_table(res)
    print("\n# the same, best decile (p10): what the ranks reach when not preempted")
    print_table(res, "p10_s")


if __name__ == "__main__":
    main()
