"""ringvod under Ray (`RayExecutor`) vs under `hvdrun --gloo`: start-up and training throughput.

```
python benchmarks/ray_vs_hvdrun.py                      # 2 workers, 5 rounds
python benchmarks/ray_vs_hvdrun.py --np 2 --rounds 3 --steps 30 --out results/x.json
```

Both sides run the same tcp-mode job: the same function (`_first_allreduce`, `_train`) on the
same number of worker processes on this machine, with one torch thread per worker.

* **start-up**: from the launch to the end of the first allreduce, as seen by the slowest rank
  (wall clock of one machine). hvdrun: `python -m launcher --gloo -np N python <this file>
  --worker ...` is started at t0. Ray: `RayExecutor.start()` is called at t0 on a Ray
  instance that is already up (the time `ray.init()` took is reported on its own), then
  `run()` of the same function. Both include the workers' Python and torch imports.
* **throughput**: a small MLP (`--width`, 3 layers), batch `--batch` per worker, SGD through
  `hvd.DistributedOptimizer`; `--warmup` steps, then `--steps` timed steps; samples/s over all
  workers, timed inside the workers (so Ray's scheduling is not counted, as hvdrun's process
  start is not). Both sides time warm processes: each hvdrun worker first runs the function
  with 2 steps, as the Ray side's executor does once before its rounds; hvdrun workers get
  `OMP_NUM_THREADS=1`, as Ray gives 1-CPU actors. Ray reuses one started executor for all its
  rounds. Also the CPU time of all workers' processes (all their threads, Ray's own
  included) per 1000 samples, which load from other processes moves much less than wall-clock
  throughput.

Rounds alternate the two sides (and which goes first), since other processes on a shared box
slow single rounds down; the report gives per-round values, medians and Ray / hvdrun. Both
sides import ringvod from a copy named on `PYTHONPATH`, else this checkout (`_library.py`); the
`LIBRARY <folder>` line above the table says which.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout


def _first_allreduce() -> float:
    import torch

    import horovod.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    return time.time()


def _train(width: int, batch: int, warmup: int, steps: int) -> dict:
    import torch

    import horovod.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    hvd.allreduce(torch.zeros(1), name="sync.start")
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    hvd.allreduce(torch.zeros(1), name="sync.end")
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"rank": hvd.rank(), "seconds": dt, "cpu_s": cpu,
            "samples_per_s": steps * batch * hvd.size() / dt,
            "cpu_ms_per_1k": 1e6 * cpu / (steps * batch * hvd.size())}


# --- hvdrun side -----------------------------------------------------------------------------

def _worker_main(argv: list[str]) -> None:
    """Inside an hvdrun worker: run one function, rank 0 prints the JSON result."""
    kind, params = argv[0], json.loads(argv[1])
    if kind == "train":  # the same warm-up run the Ray side's executor had
        _train(**dict(params, steps=2))
    out = _first_allreduce() if kind == "startup" else _train(**params)
    import horovod.torch as hvd
    times = hvd.allgather_object(out)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(times), flush=True)


def _hvdrun(np_: int, kind: str, params: dict) -> tuple[float, list]:
    cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(np_), sys.executable,
           os.path.abspath(__file__), "--worker", kind, json.dumps(params)]
    # Ray gives a 1-CPU actor OMP_NUM_THREADS=1; so do we, to compare like with like.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_library.pythonpath())
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_library.NO_LIBRARY,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"hvdrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    line = next(ln for ln in proc.stdout.splitlines() if "RESULT " in ln)
    return t0, json.loads(line.split("RESULT ", 1)[1])


# --- Ray side --------------------------------------------------------------------------------

def _ray_startup(np_: int) -> tuple[float, dict]:
    from horovod.ray import RayExecutor
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=np_)
    t0 = time.time()
    ex.start()
    try:
        ends = ex.run(_first_allreduce)
    finally:
        ex.shutdown()
    return max(ends) - t0, dict(ex.timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ray_vs_hvdrun.json"))
    args = ap.parse_args()
    params = {"width": args.width, "batch": args.batch, "warmup": args.warmup,
              "steps": args.steps}

    import ray
    # The local Ray instance inherits this environment: its workers find ringvod and this file.
    os.environ["PYTHONPATH"] = os.pathsep.join((_library.pythonpath(), HERE))
    # Ray puts the driver's working folder first on its workers' sys.path, ahead of PYTHONPATH.
    args.out = os.path.abspath(args.out)
    os.chdir(_library.NO_LIBRARY)
    t = time.time()
    ray.init(num_cpus=max(args.np, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    ray_init_s = time.time() - t
    print(f"ray.init(): {ray_init_s:.1f} s (not counted below)", flush=True)
    from horovod.ray import RayExecutor

    rows: list[dict] = []
    for r in range(args.rounds):
        order = ("hvdrun", "ray") if r % 2 == 0 else ("ray", "hvdrun")
        for side in order:
            if side == "hvdrun":
                t0, ends = _hvdrun(args.np, "startup", {})
                s = max(ends) - t0
                parts = {}
            else:
                s, parts = _ray_startup(args.np)
            rows.append({"round": r, "side": side, "metric": "startup_s", "value": s, **parts})
            detail = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            print(f"round {r} {side:6s} start-up to first allreduce: {s:6.2f} s"
                  + (f" (start(): {detail})" if detail else ""), flush=True)

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=args.np)
    ex.start()
    try:
        ex.run(_train, kwargs=dict(params, steps=2))  # imports and first init outside timing
        for r in range(args.rounds):
            order = ("hvdrun", "ray") if r % 2 == 0 else ("ray", "hvdrun")
            for side in order:
                if side == "hvdrun":
                    res = _hvdrun(args.np, "train", params)[1]
                else:
                    res = ex.run(_train, kwargs=params)
                v = min(x["samples_per_s"] for x in res)
                c = sum(x["cpu_ms_per_1k"] for x in res)  # all workers' CPU time
                rows.append({"round": r, "side": side, "metric": "samples_per_s", "value": v})
                rows.append({"round": r, "side": side, "metric": "cpu_s_per_1k_samples",
                             "value": c / 1000})
                print(f"round {r} {side:6s} training: {v:8.1f} samples/s, "
                      f"{c / 1000:.3f} CPU-s per 1000 samples", flush=True)
    finally:
        ex.shutdown()

    summary = {}
    for metric in ("startup_s", "samples_per_s", "cpu_s_per_1k_samples"):
        med = {side: statistics.median(x["value"] for x in rows
                                       if x["metric"] == metric and x["side"] == side)
               for side in ("hvdrun", "ray")}
        summary[metric] = dict(med, ray_over_hvdrun=med["ray"] / med["hvdrun"])
    print(f"\nLIBRARY {_library.where()}")
    print("| metric | hvdrun (median) | Ray (median) | Ray / hvdrun |\n|---|---|---|---|")
    for metric, m in summary.items():
        print(f"| {metric} | {m['hvdrun']:.3f} | {m['ray']:.3f} | {m['ray_over_hvdrun']:.3f} |")
    from _report import write_results
    write_results(args.out, "ray_vs_hvdrun", rows,
                  params=dict(vars(args), ray_init_s=ray_init_s, ray=ray.__version__),
                  notes=json.dumps(summary))
    print(f"written {args.out}")
    ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
    else:
        main()
