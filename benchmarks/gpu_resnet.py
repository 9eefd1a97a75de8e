"""Synthetic ResNet-50 training throughput with ringvod (the PyTorch adapter on GPUs).

The model, data and step are those of `ddp_resnet.py` (PyTorch DDP), with
`hvd.DistributedOptimizer` instead of DDP, so the two compare like with like. One process per
GPU; at 1 process the optimizer is the plain one (ringvod adds nothing). Launch::

    mpirun --allow-run-as-root --bind-to none -np 2 -x NCCL_NVLS_ENABLE=0 \
        python benchmarks/gpu_resnet.py [--amp] [--compression fp16|bf16]

Prints `RESULT impl=ringvod world=.. amp=.. compression=.. img_per_sec_total=..`.
`--profile DIR` also records one training step with torch.profiler on rank 0 and writes
`DIR/timeline_step.json` (Chrome trace: kernels per stream, NCCL on ringvod's own stream) and
`DIR/timeline_step.png` (compute vs communication kernels on a time axis).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torchvision  # noqa: E402

import frameworks.torch as hvd  # noqa: E402


def plot_trace(trace_path: str, png: str, title: str) -> str:
    """Draws the profiled step's GPU kernels per stream (NCCL in red) from a Chrome trace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("no kernels in the trace")
    t0 = min(e["ts"] for e in kernels)
    streams = sorted({e.get("args", {}).get("stream", e.get("tid")) for e in kernels},
                     key=lambda s: str(s))
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.6 * len(streams)))
    for i, s in enumerate(streams):
        mine = [e for e in kernels if e.get("args", {}).get("stream", e.get("tid")) == s]
        for color, pick in (("tab:blue", lambda n: "nccl" not in n.lower()),
                            ("tab:red", lambda n: "nccl" in n.lower())):
            bars = [((e["ts"] - t0) / 1000.0, e["dur"] / 1000.0) for e in mine
                    if pick(e.get("name", ""))]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=color)
    span = (max(e["ts"] + e["dur"] for e in kernels) - t0) / 1000.0
    for s in streams:
        mine = [e for e in kernels if e.get("args", {}).get("stream", e.get("tid")) == s]
        nc = [e for e in mine if "nccl" in e.get("name", "").lower()]
        print(f"TRACE stream {s}: {len(mine)} kernels, busy {sum(e['dur'] for e in mine) / 1e3:.1f}"
              f" of {span:.1f} ms, nccl {len(nc)} ({sum(e['dur'] for e in nc) / 1e3:.1f} ms), "
              f"first {(min(e['ts'] for e in mine) - t0) / 1e3:.1f} last "
              f"{(max(e['ts'] + e['dur'] for e in mine) - t0) / 1e3:.1f} ms", flush=True)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" for s in streams])
    ax.set_xlabel("ms (blue: compute and copies, red: NCCL)")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def phases(step_parts, a, show, label):
    """Host time of forward, backward and step (plus the GPU tail after step) per step."""
    torch.cuda.synchronize()
    parts = [step_parts() for _ in range(20)]
    med = [statistics.median(p[i] for p in parts) * 1e3 for i in range(4)]
    if show:
        print(f"PHASES {label} amp={a.amp}: forward {med[0]:.1f} ms, backward {med[1]:.1f} ms, "
              f"step {med[2]:.1f} ms, gpu tail {med[3]:.1f} ms (host times, median of 20)",
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--phases", action="store_true", help="print host time per step phase")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    p.add_argument("--profile", default="", help="directory for a one-step timeline")
    p.add_argument("--tag", default="", help="label printed with the result")
    p.add_argument("--groups", type=int, default=0, help="DistributedOptimizer(groups=N)")
    a = p.parse_args()
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if world > 1:
        comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                "bf16": hvd.Compression.bf16}[a.compression]
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=comp, groups=a.groups or None)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    def step_parts():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for _ in range(a.warmup):
        step()
    per = max(a.iters // a.repeats, 1)
    windows = []
    for _ in range(a.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(per):
            step()
        torch.cuda.synchronize()
        windows.append(a.batch * per / (time.perf_counter() - t))
    ips = torch.tensor(windows)
    if world > 1:
        ips = hvd.allreduce(ips, op=hvd.Sum, name="bench.ips")
    total = statistics.median(ips.tolist())
    if rank == 0:
        print(f"RESULT impl=ringvod{a.tag} world={world} amp={a.amp} "
              f"compression={a.compression} batch={a.batch} img_per_sec_total={total:.1f} "
              f"windows={','.join(f'{w:.0f}' for w in ips.tolist())}", flush=True)
    if a.phases:
        phases(step_parts, a, rank == 0, "ringvod" + a.tag)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if rank == 0:
            os.makedirs(a.profile, exist_ok=True)
            trace = os.path.join(a.profile, "timeline_step.json")
            prof.export_chrome_trace(trace)
            try:
                plot_trace(trace, os.path.join(a.profile, "timeline_step.png"),
                           f"one ResNet-50 step, ringvod, {world}x {torch.cuda.get_device_name()}"
                           f", amp={a.amp}, batch {a.batch}")
            except Exception as exc:  # noqa: BLE001 - the trace is still there
                print(f"timeline plot failed: {exc}")
            print(f"PROFILE {trace}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
