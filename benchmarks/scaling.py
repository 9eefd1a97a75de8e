"""Scaling run: ringvod vs DDP and raw NCCL at 1, 2, 4 and 8 GPUs of one host.

For every GPU count N (default: 1, 2, 4, 8 up to the GPUs present):

* allreduce sweep 1 KiB – 1 GiB, float32 (N ≥ 2): ringvod vs raw CuPy NCCL vs
  torch.distributed in the same processes (`gpu_allreduce.py` under `mpirun -np N`), bus
  bandwidth with the nccl-tests definition;
* ResNet-50 synthetic training, batch 64 per GPU, fp32 and bf16 autocast: ringvod
  (`gpu_resnet.py` under `mpirun -np N`, or a plain process at N = 1) vs DDP
  (`ddp_resnet.py` under `torch.distributed.run --nproc-per-node N`).

Writes `scaling.json`, `allreduce_<N>gpu.json`, `scaling_fp32.png`/`scaling_bf16.png`
(throughput vs GPUs with scaling efficiency) under $OUT and prints the tables last. Each step
has a timeout and the whole run a budget, so a device call ends in time:

    OUT=out python3 benchmarks/scaling.py --gpus 1,2,4,8 --budget 540

Run it as `benchmarks/run_gpu_suite.sh scaling [1,2,4,8]`, which sets NCCL_NVLS_ENABLE=0 and
the other multicast switches for every worker.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _report import format_table, write_results  # noqa: E402
from gpu_suite import Suite, resnet_run  # noqa: E402


def _counts(spec: str) -> list[int]:
    if spec:
        return [int(x) for x in spec.split(",") if x.strip()]
    import torch
    n = torch.cuda.device_count()
    return [k for k in (1, 2, 4, 8) if k <= n]


def allreduce_at(s: Suite, n: int, quick: bool) -> dict | None:
    path = os.path.join(s.out, f"allreduce_{n}gpu.json")
    args = [os.path.join(HERE, "gpu_allreduce.py"), "--json", path, "--lone-sizes", "4096"]
    if quick:
        args += ["--quick", "--max-bytes", str(1 << 28)]
    s.say(f"== allreduce sweep at {n} GPUs")
    s.run(s.mpi(n, args), 240)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def resnet_at(s: Suite, n: int, amp: bool, iters: int) -> list[dict]:
    """DDP then ringvod at `n` GPUs (`gpu_suite.resnet_run`), as rows for the tables and plots."""
    cfg = "bf16" if amp else "fp32"
    rows = []
    for impl in ("DDP", "ringvod"):
        v = resnet_run(s, n, impl, cfg, iters)
        if v is not None:
            rows.append({"series": impl, "gpus": n, "amp": amp, "compression": "none",
                         "throughput": v})
    return rows


def tables(s: Suite, rows: list[dict], sweeps: dict[int, dict]) -> None:
    for amp in (False, True):
        sel = [r for r in rows if r["amp"] == amp]
        if not sel:
            continue
        out = []
        base = {r["series"]: r["throughput"] for r in sel if r["gpus"] == 1}
        for n in sorted({r["gpus"] for r in sel}):
            by = {r["series"]: r["throughput"] for r in sel if r["gpus"] == n}
            rv, dd = by.get("ringvod"), by.get("DDP")
            eff = (lambda k: f"{by[k] / (n * base[k]) * 100:.0f}%" if k in by and k in base
                   else "")
            out.append([n, f"{rv:.0f}" if rv else "", f"{dd:.0f}" if dd else "",
                        f"{rv / dd:.3f}" if rv and dd else "", eff("ringvod"), eff("DDP")])
        s.say(f"ResNet-50 {'bf16 autocast' if amp else 'fp32'}, batch 64/GPU, img/s:")
        s.say(format_table(["GPUs", "ringvod", "DDP", "ringvod/DDP", "eff ringvod", "eff DDP"],
                           out))
    for n, doc in sorted(sweeps.items()):
        pipe = doc.get("results", {}).get("pipelined", [])
        big = [b for b in sorted({r["bytes"] for r in pipe}) if b >= 64 << 20]
        cells = []
        for nb in big:
            by = {r["series"]: r["busbw_gbs"] for r in pipe if r["bytes"] == nb}
            raw = by.get("CuPy NCCL") or 0.0
            cells.append(f"{nb >> 20} MiB {by.get('ringvod', 0):.0f}/{raw:.0f} GB/s "
                         f"({by.get('ringvod', 0) / raw * 100 if raw else 0:.0f}%)")
        s.say(f"allreduce busbw at {n} GPUs, ringvod/raw NCCL: " + "; ".join(cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="", help="comma list of GPU counts (default 1,2,4,8 up to "
                   "the GPUs present)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps")
    p.add_argument("--iters", type=int, default=40, help="timed steps per window")
    p.add_argument("--quick-sweep", action="store_true", help="allreduce up to 256 MiB only")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--configs", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    a = p.parse_args()
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "out")
    os.makedirs(out, exist_ok=True)
    s = Suite(out, a.budget)
    counts = _counts(a.gpus)
    rows: list[dict] = []
    sweeps: dict[int, dict] = {}
    for n in counts:
        for amp in [c == "bf16" for c in a.configs.split(",") if c in ("fp32", "bf16")]:
            if s.left() < 60:
                s.say(f"-- budget spent: skipping ResNet-50 at {n} GPUs")
                break
            rows += resnet_at(s, n, amp, a.iters)
        if n >= 2 and not a.skip_sweep and s.left() > 90:
            doc = allreduce_at(s, n, a.quick_sweep)
            if doc:
                sweeps[n] = doc
    write_results(os.path.join(out, "scaling.json"), "scaling", rows,
                  params={"counts": counts, "batch": 64})
    try:
        from _report import plot_scaling
        for amp, tag in ((False, "fp32"), (True, "bf16")):
            sel = [r for r in rows if r["amp"] == amp]
            if any(r["gpus"] == 1 for r in sel):
                plot_scaling(sel, os.path.join(out, f"scaling_{tag}.png"),
                             title=f"ResNet-50 {tag}, batch 64/GPU")
    except Exception as exc:  # noqa: BLE001 - the tables are the result
        s.say(f"plot failed: {exc}")
    tables(s, rows, sweeps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
