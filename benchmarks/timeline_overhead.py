"""What the timeline costs: per-event cost on the coordinator, writer throughput, step overhead.

    python benchmarks/timeline_overhead.py [--tensors 160] [--steps 200] [--out results/]
    python benchmarks/timeline_overhead.py --e2e [--np 2]    # also time real allreduce steps
    python benchmarks/timeline_overhead.py --torch --np 2    # and CPU training steps

Parts:

1. **Coordinator cost per event call** (`negotiate_start`, `start`, `end`, ...): the time the
   calling thread spends per call with the timeline writing, stopped, and absent (`None`, the
   coordinator's `if tl is not None` check). The writer thread runs meanwhile.
2. **Writer cost per event**: wall time from the first event of a burst until `flush()`
   returns, divided by the events: what the writer thread takes (formatting + pwrite) while
   holding the GIL for most of it.
3. **Simulated coordinator step**: N tensors, each with ~`--work-us` of Python work (standing in
   for negotiation and engine bookkeeping) and Horovod's event pattern (negotiate start, one
   ready per rank, negotiate end, start, 4 activities, end). Step time with the timeline on vs
   off is the overhead a GIL-bound coordinator sees, writer included.
4. (`--e2e`) **Real steps**: `--tensors` small allreduces per step through `collective`, in
   fresh processes (single process, or `mpirun -np N` with `--np`), with `HOROVOD_TIMELINE`
   set vs unset.
5. (`--torch`) **Training steps**: a CNN with ResNet-50's 161 parameter tensors, trained on CPU
   with `frameworks.torch.DistributedOptimizer`, timeline on vs off.

Prints `LIBRARY <folder>` (where ringvod was imported from: a copy named on `PYTHONPATH`, else
this checkout; `_library.py`) above the tables. Results go to `<out>/timeline_overhead.json`
(see `_report.write_results`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

from _report import Progress, format_table, write_results  # noqa: E402

from collective.timeline import Timeline  # noqa: E402

ACTIVITIES = ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER")
RANKS = 2
EVENTS_PER_TENSOR = 4 + RANKS + 2 * len(ACTIVITIES)  # B neg, X per rank, E neg, B op, acts, E


def _step(tl, names, work_us: float = 0.0) -> None:
    """One step of Horovod's event pattern; `work_us` of busy Python per tensor."""
    spin = work_us / 1e6
    for n in names:
        if spin:
            t_end = time.perf_counter() + spin
            while time.perf_counter() < t_end:
                pass
        if tl is not None:
            tl.negotiate_start(n, "ALLREDUCE")
            for r in range(RANKS):
                tl.negotiate_rank_ready(n, r)
            tl.negotiate_end(n)
            tl.start(n, "ALLREDUCE")
    if tl is not None:
        for act in ACTIVITIES:
            tl.activity_start_all(names, act)
            tl.activity_end_all(names)
        for n in names:
            tl.end(n, "float32", (1024,))


def per_call_cost(path: str, calls: int) -> dict:
    """ns per event call for a writing, a stopped and an absent timeline."""
    out = {}
    for label in ("writing", "stopped", "absent"):
        tl = Timeline(path if label == "writing" else "")
        obj = tl if label != "absent" else None
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            if obj is None:
                for i in range(calls):
                    if obj is not None:  # the coordinator's guard
                        pass
            else:
                for i in range(calls):
                    obj.negotiate_rank_ready("allreduce.x", 1)
            best = min(best, (time.perf_counter_ns() - t0) / calls)
            tl.flush()
        tl.close()
        out[label] = best
    # A loop-only baseline, so the call's own cost can be read off.
    t0 = time.perf_counter_ns()
    for i in range(calls):
        pass
    out["empty_loop"] = (time.perf_counter_ns() - t0) / calls
    return out


def writer_cost(path: str, names, steps: int) -> dict:
    """µs per event for producing a burst and for the writer to drain it."""
    tl = Timeline(path, mark_cycles=True)
    _step(tl, names)
    tl.flush()
    # CPU clocks of both threads: robust against other load on the machine.
    wclock = time.pthread_getcpuclockid(tl._thread.ident)
    events = steps * len(names) * EVENTS_PER_TENSOR
    w0, c0, t0 = time.clock_gettime(wclock), time.thread_time(), time.perf_counter()
    for _ in range(steps):
        tl.mark_cycle()
        _step(tl, names)
    c1 = time.thread_time()
    tl.flush()
    w1, t2 = time.clock_gettime(wclock), time.perf_counter()
    tl.close()
    size = os.path.getsize(path)
    return {"events": events,
            "producer_cpu_us_per_event": (c1 - c0) / events * 1e6,
            "writer_cpu_us_per_event": (w1 - w0) / events * 1e6,
            "burst_wall_us_per_event": (t2 - t0) / events * 1e6,
            "bytes_per_event": size / events, "file_mb": size / 1e6}


def simulated_steps(path: str, names, steps: int, work_us: float, reps: int) -> dict:
    """Best step time (ms) of `reps` with the timeline on / stopped / absent, interleaved."""
    times: dict[str, list[float]] = {"on": [], "stopped": [], "absent": []}
    tls = {"on": Timeline(path), "stopped": Timeline(""), "absent": None}
    with Progress(reps * 3, "simulated steps") as bar:
        for _ in range(reps):
            for label, tl in tls.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(tl, names, work_us)
                if tl is not None:
                    tl.flush()  # the writer's work counts for "on"
                times[label].append((time.perf_counter() - t0) / steps * 1e3)
                bar.update(note=label)
    for tl in tls.values():
        if tl is not None:
            tl.close()
    med = {k: min(v) for k, v in times.items()}  # min: least disturbed by other load
    med["overhead_on_vs_absent_pct"] = 100 * (med["on"] / med["absent"] - 1)
    med["overhead_stopped_vs_absent_pct"] = 100 * (med["stopped"] / med["absent"] - 1)
    return med


E2E_CHILD = r"""
import os, sys, time, json, statistics
import numpy as np
import collective as hvd
hvd.init()
n, steps = int(sys.argv[1]), int(sys.argv[2])
xs = [np.ones(256, np.float32) for _ in range(n)]
def step():
    hs = [hvd.allreduce_async(x, name=f"t{i}", op=hvd.Sum) for i, x in enumerate(xs)]
    for h in hs:
        hvd.synchronize(h)
for _ in range(5):
    step()
from collective import _current as _rt
tl = _rt.current_or_none().coordinator.timeline
clock = time.pthread_getcpuclockid(tl._thread.ident) if tl is not None and tl.enabled else None
w0 = time.clock_gettime(clock) if clock is not None else 0.0
ts = []
for _ in range(steps):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
if hvd.rank() == 0:
    res = {"median_ms": statistics.median(ts) * 1e3, "mean_ms": statistics.mean(ts) * 1e3}
    if clock is not None:
        tl.flush()
        res["writer_cpu_ms_per_step"] = (time.clock_gettime(clock) - w0) * 1e3 / steps
    print(json.dumps(res))
hvd.shutdown()
"""


TORCH_CHILD = r"""
import os, sys, time, json, statistics
import torch
import frameworks.torch as hvd
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
steps = int(sys.argv[2])
# 53 conv+BN blocks and a classifier: 161 parameter tensors, as many as ResNet-50.
layers = []
for _ in range(53):
    layers += [torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
               torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10))
assert len(list(model.parameters())) == 161
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(8, 16, 8, 8), torch.randint(0, 10, (8,))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(5):
    step()
from collective import _current as _rt
tl = _rt.current_or_none().coordinator.timeline
clock = time.pthread_getcpuclockid(tl._thread.ident) if tl is not None and tl.enabled else None
w0 = time.clock_gettime(clock) if clock is not None else 0.0
ts = []
for _ in range(steps):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
if hvd.rank() == 0:
    res = {"median_ms": statistics.median(ts) * 1e3, "mean_ms": statistics.mean(ts) * 1e3}
    if clock is not None:
        tl.flush()
        res["writer_cpu_ms_per_step"] = (time.clock_gettime(clock) - w0) * 1e3 / steps
    print(json.dumps(res))
hvd.shutdown()
"""


def e2e(tensors: int, steps: int, np_: int, reps: int, tmp: str,
        torch_model: bool = False) -> dict:
    """Median step time of real allreduce steps with and without HOROVOD_TIMELINE."""
    script = os.path.join(tmp, "e2e_child.py")
    with open(script, "w") as f:
        f.write(TORCH_CHILD if torch_model else E2E_CHILD)
    res: dict[str, list[float]] = {"off": [], "on": []}
    writer_ms: list[float] = []
    with Progress(2 * reps, f"{'torch' if torch_model else 'e2e'} np={np_}",
                  show_after=0) as bar:
        for _ in range(reps):
            for label in ("off", "on"):
                env = dict(os.environ, PYTHONPATH=_library.pythonpath(),
                           OMPI_MCA_mpi_yield_when_idle="1")
                env.pop("HOROVOD_TIMELINE", None)
                if label == "on":
                    env["HOROVOD_TIMELINE"] = os.path.join(tmp, "e2e.json")
                cmd = [sys.executable, script, str(tensors), str(steps)]
                if np_ > 1:
                    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to",
                           "none", "-np", str(np_), "-x", "PYTHONPATH", "-x",
                           "OMPI_MCA_mpi_yield_when_idle"] + (
                        ["-x", "HOROVOD_TIMELINE"] if label == "on" else []) + cmd
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
                if out.returncode != 0:
                    raise RuntimeError(f"e2e child failed ({label}):\n{out.stdout}\n{out.stderr}")
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
                got = json.loads(line)
                res[label].append(got["median_ms"])
                if "writer_cpu_ms_per_step" in got:
                    writer_ms.append(got["writer_cpu_ms_per_step"])
                bar.update(note=label)
    # min over runs: the least disturbed by other load (2-rank CPU runs are bimodal).
    med = {k: min(v) for k, v in res.items()}
    med["runs_off"], med["runs_on"] = res["off"], res["on"]
    med["overhead_pct"] = 100 * (med["on"] / med["off"] - 1)
    if writer_ms:
        med["writer_cpu_ms_per_step"] = statistics.median(writer_ms)
        med["writer_cpu_pct_of_step"] = 100 * med["writer_cpu_ms_per_step"] / med["off"]
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=160, help="tensors per step (ResNet-50: 161)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--work-us", type=float, default=20.0,
                   help="simulated coordinator work per tensor (µs of Python)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--e2e", action="store_true", help="also time real allreduce steps")
    p.add_argument("--torch", action="store_true",
                   help="also time training steps of a 161-tensor CNN (frameworks.torch)")
    p.add_argument("--np", type=int, default=1,
                   help="ranks for --e2e/--torch (mpirun when > 1)")
    p.add_argument("--out", default="results")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="tl-bench-")
    try:
        path = os.path.join(tmp, "t.json")
        names = [f"allreduce.layer{i}.weight" for i in range(args.tensors)]
        calls = per_call_cost(path, args.calls)
        writer = writer_cost(path, names, args.steps)
        sim = simulated_steps(path, names, max(1, args.steps // 5), args.work_us, args.reps)
        e2e_res = e2e(args.tensors, args.steps, args.np, max(3, args.reps // 2), tmp) \
            if args.e2e else None
        torch_res = e2e(args.tensors, args.steps, args.np, max(3, args.reps // 2), tmp,
                        torch_model=True) if args.torch else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"LIBRARY {_library.where()}")
    print(format_table(["coordinator call", "ns/call"],
                       [[k, round(v, 1)] for k, v in calls.items()]))
    print()
    print(format_table(["writer", "value"], [[k, round(v, 3)] for k, v in writer.items()]))
    print()
    print(f"simulated step: {args.tensors} tensors x {EVENTS_PER_TENSOR} events, "
          f"{args.work_us:g} us work per tensor")
    print(format_table(["timeline", "ms/step or %"], [[k, round(v, 3)] for k, v in sim.items()]))
    if e2e_res:
        print()
        print(f"real steps ({args.tensors} x allreduce of 1 KiB, np={args.np}): "
              f"off {e2e_res['off']:.3f} ms, on {e2e_res['on']:.3f} ms, "
              f"overhead {e2e_res['overhead_pct']:+.1f}%, writer thread "
              f"{e2e_res.get('writer_cpu_ms_per_step', 0):.3f} ms CPU/step")
    if torch_res:
        print(f"torch training steps (161-tensor CNN, CPU, np={args.np}): "
              f"off {torch_res['off']:.3f} ms, on {torch_res['on']:.3f} ms, "
              f"overhead {torch_res['overhead_pct']:+.1f}%, writer thread "
              f"{torch_res.get('writer_cpu_ms_per_step', 0):.3f} ms CPU/step "
              f"({torch_res.get('writer_cpu_pct_of_step', 0):.1f}% of a step)")
    doc = write_results(os.path.join(args.out, "timeline_overhead.json"), "timeline_overhead",
                        {"per_call_ns": calls, "writer": writer, "simulated_step_ms": sim,
                         "e2e_step_ms": e2e_res, "torch_step_ms": torch_res},
                        params=vars(args) | {"events_per_tensor": EVENTS_PER_TENSOR})
    print(f"\nwrote {os.path.join(args.out, 'timeline_overhead.json')} "
          f"({doc['machine'].get('cpu', doc['machine']['platform'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
