"""Autotune on the CPU: a sweep of fixed settings against `HOROVOD_AUTOTUNE=1`.

Usage::

    python benchmarks/autotune_cpu.py [--np 2] [--rounds 3] [--tensors 16] [--kib 8192]
                                      [--steps 300] [--fixed-steps 60] [--json out.json]
    python benchmarks/autotune_cpu.py --torch [--layers 160] [--width 128] [--batch 32]
                                      [--steps 400] [--fixed-steps 80] [--json out.json]

The workload is one training step's worth of gradient allreduces: `--tensors` float32 tensors
of `--kib` KiB each, submitted at once (`allreduce_async_`) and then synchronized, in tcp mode
(`hvdrun --gloo`). Every run is a fresh job:

* ``fixed T``: `HOROVOD_FUSION_THRESHOLD=T` for each threshold of the sweep (the default
  128 MB included), `--fixed-steps` steps; its throughput is the median step of the second
  half of the run.
* ``autotune``: `HOROVOD_AUTOTUNE=1` with `HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE` (default 2) and
  the other autotune settings at Horovod's defaults, starting from the defaults. Reported: the
  step at which tuning ended, the chosen threshold and cycle time, and the median step after
  tuning ended (the tuned throughput); `--steps` steps.

`--torch`: a training step of a torch model with many small parameter tensors, where the
`DistributedOptimizer` bucket size matters: `--layers` `nn.Linear(width, width)` + ReLU layers
(2 parameter tensors each), SGD, MSE against a fixed random batch of `--batch` rows,
`torch.set_num_threads(1)`, `hvd.DistributedOptimizer` and `broadcast_parameters`. Fixed
variants sweep `HOROVOD_BUCKET_CAP_MB` (`--buckets-mb`, the default 25 included) at the
default fusion threshold and cycle time, `HOROVOD_CYCLE_TIME` (`--cycles-ms`) at a few bucket
sizes (`--cycle-buckets-mb`), and `--thresholds-mb` (none by default) at the default bucket
size; the autotune
variant starts from the defaults and writes its CSV log (`HOROVOD_AUTOTUNE_LOG`), from which the
bucket sizes it scored are reported. Throughput = steps/s (1 / the median step time, same
halves as above); the autotune run also reports the bucket size, threshold, cycle time and
cache setting in force at its end.

Runs alternate (round robin over all variants, `--rounds` times) so a noisy neighbour hits all
alike; figures are medians over rounds. Throughput = bytes reduced per step / step time (steps/s
with `--torch`). Ranks import ringvod from a copy named on `PYTHONPATH`, else this checkout
(`_library.py`); the `LIBRARY <folder>` line above the summary says which.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1024 * 1024
THRESHOLDS_MB = (0, 1, 4, 16, 64, 128)
BUCKETS_MB = (0.25, 1, 4, 25)  # --torch: fixed bucket sizes (at the default threshold)
TORCH_THRESHOLDS_MB = ()  # --torch: fixed thresholds (at the default bucket size)
TORCH_CYCLES_MS = ()  # --torch: fixed cycle times (default 1 ms), at TORCH_CYCLE_BUCKETS_MB
TORCH_CYCLE_BUCKETS_MB = (4, 25)


def worker(out: str, tensors: int, kib: int, steps: int) -> None:
    import time

    import numpy as np

    import collective as hvd
    from collective import _current
    hvd.init()
    tuning = _current.current().coordinator.tuning
    n = kib * 1024 // 4
    grads = [np.ones(n, np.float32) for _ in range(tensors)]
    times, ended = [], None
    for step in range(steps):
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"g{i}") for i, g in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)
        times.append(time.perf_counter() - t0)
        for g in grads:
            g.fill(1.0)
        if ended is None and tuning.retunes and not tuning.retunes[-1][1].active:
            ended = step
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "ended": ended, "bytes": tensors * n * 4,
                       "final": [tuning.fusion_threshold, tuning.cycle_time * 1000],
                       "switches": len(tuning.retunes)}, f)
    hvd.shutdown()


def torch_worker(out: str, layers: int, width: int, batch: int, steps: int) -> None:
    import time

    import torch

    import horovod.torch as hvd
    from collective import _current
    torch.set_num_threads(1)
    hvd.init()
    tuning = _current.current().coordinator.tuning
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1 + hvd.rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    reducer = opt._hvd_reducer
    times, ended, caps = [], None, []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        caps.append(reducer.cap_mb)
        if ended is None and tuning.retunes and not tuning.retunes[-1][1].active:
            ended = step
    if hvd.rank() == 0:
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        with open(out, "w") as f:
            json.dump({"times": times, "ended": ended, "bytes": nbytes,
                       "tensors": len(list(model.parameters())),
                       "final": [tuning.fusion_threshold, tuning.cycle_time * 1000,
                                 reducer.cap_mb, tuning.cache_capacity > 0],
                       "caps_in_force": sorted(set(caps)),
                       "switches": len(tuning.retunes)}, f)
    hvd.shutdown()


def _csv_buckets(path: str) -> list[float]:
    """The bucket sizes of the scored rows of an autotune CSV log (the last row: the result)."""
    try:
        with open(path) as f:
            rows = [line.strip().split(",") for line in f][1:]
    except OSError:
        return []
    return [float(r[7]) for r in rows[:-1] if len(r) >= 8]


def run_one(env_extra: dict, args: argparse.Namespace, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(env_extra)
        env["PYTHONPATH"] = _library.pythonpath()
        cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(args.np), sys.executable,
               os.path.abspath(__file__), "--worker", out, "--steps", str(steps)]
        if args.torch:
            log = os.path.join(d, "autotune.csv")
            if env.get("HOROVOD_AUTOTUNE") == "1":
                env["HOROVOD_AUTOTUNE_LOG"] = log
            cmd += ["--torch", "--layers", str(args.layers), "--width", str(args.width),
                    "--batch", str(args.batch)]
        else:
            cmd += ["--tensors", str(args.tensors), "--kib", str(args.kib)]
        subprocess.run(cmd, cwd=_library.NO_LIBRARY, env=env, check=True, timeout=900,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            res = json.load(f)
        if args.torch and env.get("HOROVOD_AUTOTUNE") == "1":
            res["csv_buckets_mb"] = _csv_buckets(log)
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--kib", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=300, help="steps of an autotune run")
    ap.add_argument("--fixed-steps", type=int, default=60, help="steps of a fixed-setting run")
    ap.add_argument("--steps-per-sample", type=int, default=2)
    ap.add_argument("--thresholds-mb", default=None,
                    help=f"fixed fusion thresholds (default {THRESHOLDS_MB}; with --torch: "
                         f"{TORCH_THRESHOLDS_MB})")
    ap.add_argument("--torch", action="store_true",
                    help="a torch model with many small parameters (bucket size sweep)")
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--buckets-mb", default=",".join(map(str, BUCKETS_MB)),
                    help="fixed bucket sizes (--torch)")
    ap.add_argument("--cycles-ms", default=",".join(map(str, TORCH_CYCLES_MS)),
                    help="fixed cycle times (--torch), each at every --cycle-buckets-mb")
    ap.add_argument("--cycle-buckets-mb", default=",".join(map(str, TORCH_CYCLE_BUCKETS_MB)))
    ap.add_argument("--json")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        if args.torch:
            torch_worker(args.worker, args.layers, args.width, args.batch, args.steps)
        else:
            worker(args.worker, args.tensors, args.kib, args.steps)
        return
    if args.thresholds_mb is None:
        args.thresholds_mb = ",".join(map(str, TORCH_THRESHOLDS_MB if args.torch
                                          else THRESHOLDS_MB))
    thresholds = [float(x) for x in args.thresholds_mb.split(",") if x]
    variants: dict[str, dict[str, str]] = {}
    if args.torch:
        for b in (float(x) for x in args.buckets_mb.split(",") if x):
            variants[f"bucket {b:g} MB"] = {"HOROVOD_BUCKET_CAP_MB": str(b)}
        for c in (float(x) for x in args.cycles_ms.split(",") if x):
            for b in (float(x) for x in args.cycle_buckets_mb.split(",") if x):
                variants[f"bucket {b:g} MB cycle {c:g} ms"] = {
                    "HOROVOD_BUCKET_CAP_MB": str(b), "HOROVOD_CYCLE_TIME": str(c)}
    for t in thresholds:
        variants[f"fixed {t:g} MB"] = {"HOROVOD_FUSION_THRESHOLD": str(int(t * MB))}
    variants["autotune"] = {"HOROVOD_AUTOTUNE": "1",
                            "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.steps_per_sample)}
    res: dict[str, list[dict]] = {k: [] for k in variants}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for name, env in variants.items():
            out = run_one(env, args, args.steps if name == "autotune" else args.fixed_steps)
            times = out["times"]
            if name == "autotune":
                tail = times[out["ended"] + 1:] if out["ended"] is not None else []
            else:
                tail = times[len(times) // 2:]
            if args.torch:
                tput = 1.0 / statistics.median(tail) if tail else float("nan")
            else:
                tput = out["bytes"] / statistics.median(tail) / MB if tail else float("nan")
            row = {"mbps" if not args.torch else "steps_per_s": tput, "ended": out["ended"],
                   "final": out["final"]}
            if args.torch and name == "autotune":
                row["csv_buckets_mb"] = out.get("csv_buckets_mb", [])
                row["caps_in_force"] = out["caps_in_force"]
            res[name].append(row)
            extra = ""
            if name == "autotune":
                f = out["final"]
                extra = (f" tuning ended at step {out['ended']}, chose {f[0] / MB:g} MB / "
                         f"{f[1]:g} ms")
                if args.torch:
                    extra += (f" / bucket {f[2]:g} MB / cache {'on' if f[3] else 'off'}; "
                              f"bucket sizes scored {sorted(set(row['csv_buckets_mb']))}")
            unit = "steps/s" if args.torch else "MB/s"
            print(f"round {r + 1}/{args.rounds} {name:>26}: {tput:8.2f} {unit}{extra}",
                  flush=True)
    key = "steps_per_s" if args.torch else "mbps"
    unit = "steps/s" if args.torch else "MB/s"
    med = {k: statistics.median(x[key] for x in v) for k, v in res.items()}
    best = max((k for k in med if k != "autotune"), key=med.get)
    if args.torch:
        what = (f"torch {args.layers} x Linear({args.width}, {args.width}) (+ReLU), batch "
                f"{args.batch}, {2 * args.layers} parameter tensors")
    else:
        what = f"{args.tensors} x {args.kib} KiB float32 per step"
    print(f"\nLIBRARY {_library.where()}")
    print(f"{args.np} ranks tcp, {what}, {args.fixed_steps} steps fixed, {args.steps} "
          f"autotune (steps per sample {args.steps_per_sample}), median of {args.rounds} "
          f"rounds")
    for k, v in med.items():
        print(f"  {k:>26}: {v:8.2f} {unit}  {v / med[best]:.3f}x best fixed ({best})")
    ends = [x["ended"] for x in res["autotune"]]
    if args.torch:
        chosen = [(x["final"][0] / MB, x["final"][1], x["final"][2], x["final"][3])
                  for x in res["autotune"]]
        print(f"  autotune ended at steps {ends}; chose {chosen} (threshold MB, cycle ms, "
              f"bucket MB, cache); bucket sizes scored "
              f"{[sorted(set(x['csv_buckets_mb'])) for x in res['autotune']]}")
    else:
        print(f"  autotune ended at steps {ends}; chose "
              f"{[(x['final'][0] / MB, x['final'][1]) for x in res['autotune']]} (MB, ms)")
    if args.json:
        with open(args.json, "w") as f:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip()
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.node(),
                       "cpu": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "commit": commit,
                       "library": _library.where(),
                       "python": platform.python_version(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "args": vars(args), "runs": res,
                       "median_steps_per_s" if args.torch else "median_mbps": med,
                       "best_fixed": best,
                       "autotune_vs_best_fixed": med["autotune"] / med[best]}, f, indent=1)


if __name__ == "__main__":
    main()
