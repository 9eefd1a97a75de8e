"""Autotune on the CPU: a sweep of fixed fusion thresholds against `HOROVOD_AUTOTUNE=1`.

Usage::

    python benchmarks/autotune_cpu.py [--np 2] [--rounds 3] [--tensors 16] [--kib 8192]
                                      [--steps 300] [--fixed-steps 60] [--json out.json]

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

Runs alternate (round robin over all variants, `--rounds` times) so a noisy neighbour hits all
alike; figures are medians over rounds. Throughput = bytes reduced per step / step time.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1024 * 1024
THRESHOLDS_MB = (0, 1, 4, 16, 64, 128)


def worker(out: str, tensors: int, kib: int, steps: int) -> None:
    import time

    import numpy as np
    sys.path.insert(0, REPO)
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


def run_one(env_extra: dict, args: argparse.Namespace, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(env_extra)
        env["PYTHONPATH"] = REPO
        cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(args.np), sys.executable,
               os.path.abspath(__file__), "--worker", out, "--tensors", str(args.tensors),
               "--kib", str(args.kib), "--steps", str(steps)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=900,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--kib", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=300, help="steps of an autotune run")
    ap.add_argument("--fixed-steps", type=int, default=60, help="steps of a fixed-setting run")
    ap.add_argument("--steps-per-sample", type=int, default=2)
    ap.add_argument("--thresholds-mb", default=",".join(map(str, THRESHOLDS_MB)))
    ap.add_argument("--json")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.tensors, args.kib, args.steps)
        return
    thresholds = [float(x) for x in args.thresholds_mb.split(",")]
    variants = {f"fixed {t:g} MB": {"HOROVOD_FUSION_THRESHOLD": str(int(t * MB))}
                for t in thresholds}
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
            tput = out["bytes"] / statistics.median(tail) / MB if tail else float("nan")
            res[name].append({"mbps": tput, "ended": out["ended"], "final": out["final"]})
            extra = (f" tuning ended at step {out['ended']}, chose "
                     f"{out['final'][0] / MB:g} MB / {out['final'][1]:g} ms"
                     if name == "autotune" else "")
            print(f"round {r + 1}/{args.rounds} {name:>14}: {tput:8.1f} MB/s{extra}",
                  flush=True)
    med = {k: statistics.median(x["mbps"] for x in v) for k, v in res.items()}
    best = max((k for k in med if k != "autotune"), key=med.get)
    print(f"\n{args.np} ranks tcp, {args.tensors} x {args.kib} KiB float32 per step, "
          f"{args.fixed_steps} steps fixed, {args.steps} autotune (steps per sample "
          f"{args.steps_per_sample}), median of {args.rounds} rounds")
    for k, v in med.items():
        print(f"  {k:>14}: {v:8.1f} MB/s  {v / med[best]:.3f}x best fixed ({best})")
    ends = [x["ended"] for x in res["autotune"]]
    print(f"  autotune ended at steps {ends}; chose "
          f"{[(x['final'][0] / MB, x['final'][1]) for x in res['autotune']]} (MB, ms)")
    if args.json:
        with open(args.json, "w") as f:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip()
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.node(),
                       "cpu": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "commit": commit,
                       "python": platform.python_version(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "args": vars(args), "runs": res,
                       "median_mbps": med, "best_fixed": best}, f, indent=1)


if __name__ == "__main__":
    main()
