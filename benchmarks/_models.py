"""The models of the training benchmarks (`gpu_resnet.py`, `ddp_resnet.py`), built alike for both.

`build(name, device, batch)` returns a `Workload`: the model on `device`, one synthetic batch
(inputs and targets, made once) and the loss. A training step is::

    loss = w.loss(w.model(w.x), w.y)

* `resnet50`: torchvision's ResNet-50 in channels_last, images 3x224x224, 1000 classes; the
  unit is images/s.
* `transformer`: a BERT-base-shaped encoder from plain `torch.nn` (nothing downloaded): token
  embedding (vocabulary 30522, width 768) + learned position embedding (512) + LayerNorm, 12
  `nn.TransformerEncoderLayer` (12 heads, feed-forward 3072, GELU, post-norm as BERT), and a
  masked-LM-like head on every token (Linear 768x768, GELU, LayerNorm, Linear to the
  vocabulary). 154 parameter tensors (12 per layer), ~133 M parameters (the output layer is
  not tied to the embedding): many small gradients, which is what bucketing is for. Batches
  are `batch` sequences of `seq` tokens; the unit is samples (sequences)/s.

The memory helpers make the `MEMORY ...` line both scripts print after their timed windows:
the peak of torch's allocator (allocated and reserved, reset after warm-up so it is the
steady-state training peak) and the device's used memory (total - free, which includes what
torch's allocator does not see: the CUDA context, NCCL's buffers, CuPy's pool); for ringvod
also what ringvod itself holds (`ringvod_memory`). Every reading that fails prints `?` and
on CPU `n/a`: a benchmark never dies for its memory report.

The run itself is shared too: `add_args` (the options both scripts take), `make_steps` (the
training step, and the same step timed by phase), `time_windows` (warm-up, then the timed
windows: samples/s of each) and `phases` (the `PHASES ...` line).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_BATCH",
    "MODELS",
    "VOCAB",
    "Workload",
    "add_args",
    "build",
    "device_used",
    "make_steps",
    "memory_line",
    "phases",
    "plot_trace",
    "profile_step",
    "reset_peak",
    "ringvod_memory",
    "synchronizer",
    "time_windows",
]

MODELS = ("resnet50", "transformer")
DEFAULT_BATCH = {"resnet50": 64, "transformer": 32}
VOCAB = 30522


@dataclass
class Workload:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit: str  # what one sample is: "img/s" or "samples/s"

    @property
    def tensors(self) -> int:
        return sum(1 for p in self.model.parameters() if p.requires_grad)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def describe(self, name: str) -> str:
        return (f"MODEL model={name} param_tensors={self.tensors} "
                f"params={self.params / 1e6:.1f}M batch={self.x.shape[0]} unit={self.unit}")


class Encoder(nn.Module):
    """BERT-base-shaped encoder with a masked-LM-like head (see the module docstring)."""

    def __init__(self, layers: int = 12, dim: int = 768, heads: int = 12, ff: int = 3072,
                 vocab: int = VOCAB, max_len: int = 512) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.norm = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim),
                                  nn.Linear(dim, vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.norm(self.tok(tokens) + self.pos(pos))
        return self.head(self.encoder(h))


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(name: str, device: Any, batch: int, seq: int = 128, layers: int = 12,
          vocab: int = VOCAB) -> Workload:
    """The model `name` on `device` with one synthetic batch of `batch` samples.

    `seq`, `layers` and `vocab` apply to `transformer` only (smaller ones for smoke tests).

    Raises:
        ValueError: unknown `name`, or `seq` above the 512 positions.
    """
    device = torch.device(device)
    if name == "resnet50":
        import torchvision
        model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
        x = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        return Workload(model, x, y, nn.functional.cross_entropy, "img/s")
    if name == "transformer":
        if not 0 < seq <= 512:
            raise ValueError(f"--seq must be 1..512, got {seq}")
        model = Encoder(layers=layers, vocab=vocab).to(device)
        x = torch.randint(0, vocab, (batch, seq), device=device)
        y = torch.randint(0, vocab, (batch, seq), device=device)
        return Workload(model, x, y, _lm_loss, "samples/s")
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


# -- the run -------------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    """The options of both scripts: the workload, the timed windows, `--amp`, `--phases`,
    `--compression`, `--profile` and `--compile`."""
    p.add_argument("--model", default="resnet50", choices=MODELS)
    p.add_argument("--batch", type=int, default=0,
                   help="per process (default: 64 for resnet50, 32 for transformer)")
    p.add_argument("--seq", type=int, default=128, help="transformer: tokens per sample")
    p.add_argument("--layers", type=int, default=12, help="transformer: encoder layers")
    p.add_argument("--vocab", type=int, default=VOCAB, help="transformer: vocabulary")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--phases", action="store_true", help="print host time per step phase")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    p.add_argument("--profile", default="", help="directory for a one-step timeline (rank 0)")
    p.add_argument("--profile-name", default="timeline_step",
                   help="file stem of the timeline: DIR/NAME.json and DIR/NAME.png")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (DDP: the DDP-wrapped model, as PyTorch "
                   "recommends); the first warm-up step compiles")


def maybe_compile(model: nn.Module, compile_: bool) -> nn.Module:
    """`torch.compile(model)` when `compile_`, else `model`: forward and backward then run as
    compiled graphs, so kernel launches leave the Python thread. The gradients' hooks (ringvod's
    optimizer, DDP's reducer) still run per parameter after the compiled backward."""
    return torch.compile(model) if compile_ else model


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work: CUDA's synchronize; on CPU nothing."""
    if device.type == "cuda":
        def sync() -> None:
            torch.cuda.synchronize()
    else:
        def sync() -> None:
            pass
    return sync


def make_steps(model: nn.Module, opt: Any, w: Workload, device: torch.device, amp: bool,
               sync: Callable[[], None]) -> tuple[Callable[[], None], Callable[[], tuple]]:
    """`(step, step_parts)` for `model` (the workload's, or a wrapper of it such as DDP) and
    `opt`. `step()`: zero the gradients, forward and loss (under bf16 autocast when `amp`),
    backward, optimizer step. `step_parts()`: the same step, returning its host seconds of
    forward (with the zeroing), backward, step, and the device's tail after step (`sync`)."""
    x, y = w.x, w.y

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = w.loss(model(x), y)
        loss.backward()
        opt.step()

    def step_parts() -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = w.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    return step, step_parts


def time_windows(step: Callable[[], None], sync: Callable[[], None], device: torch.device,
                 batch: int, warmup: int, iters: int,
                 repeats: int) -> tuple[list[float], float | None]:
    """`warmup` steps, then the allocator's peak reset (`reset_peak`) and `repeats` timed
    windows of `iters // repeats` steps (at least one) of `batch` samples each. Returns the
    samples/s of each window and the largest `device_used` after a window (None on CPU)."""
    for _ in range(warmup):
        step()
    reset_peak(device)
    per = max(iters // repeats, 1)
    windows, used = [], []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(per):
            step()
        sync()
        windows.append(batch * per / (time.perf_counter() - t))
        used.append(device_used(device))
    seen = [u for u in used if u is not None]
    return windows, max(seen) if seen else None


def phases(step_parts: Callable[[], tuple], amp: bool, sync: Callable[[], None], show: bool,
           label: str) -> None:
    """Host time of forward, backward and step (plus the GPU tail after step) per step: the
    medians of 20 `step_parts()`, printed as a `PHASES` line where `show`."""
    sync()
    parts = [step_parts() for _ in range(20)]
    med = [statistics.median(p[i] for p in parts) * 1e3 for i in range(4)]
    if show:
        print(f"PHASES {label} amp={amp}: forward {med[0]:.1f} ms, backward {med[1]:.1f} ms, "
              f"step {med[2]:.1f} ms, gpu tail {med[3]:.1f} ms (host times, median of 20)",
              flush=True)


# -- memory -------------------------------------------------------------------------------------
_MIB = 1024.0 * 1024.0


def plot_trace(trace_path: str, png: str, title: str) -> None:
    """Draws a profiled step's GPU kernels per stream (NCCL in red) from its Chrome trace and
    prints a `TRACE stream ...` line per stream: kernels, busy time, NCCL time, first/last."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("no kernels in the trace")

    def stream(e: dict) -> Any:
        return e.get("args", {}).get("stream", e.get("tid"))

    t0 = min(e["ts"] for e in kernels)
    span = (max(e["ts"] + e["dur"] for e in kernels) - t0) / 1000.0
    streams = sorted({stream(e) for e in kernels}, key=str)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.6 * len(streams)))
    for i, s in enumerate(streams):
        mine = [e for e in kernels if stream(e) == s]
        nc = [e for e in mine if "nccl" in e.get("name", "").lower()]
        for color, sel in (("tab:blue", [e for e in mine if e not in nc]), ("tab:red", nc)):
            if sel:
                ax.broken_barh([((e["ts"] - t0) / 1000.0, e["dur"] / 1000.0) for e in sel],
                               (i - 0.4, 0.8), facecolors=color)
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


def profile_step(step: Callable[[], None], sync: Callable[[], None], device: torch.device,
                 a: argparse.Namespace, show: bool, title: str) -> None:
    """`--profile DIR`: two more steps, then one step under torch.profiler; on the rank that
    shows, `DIR/NAME.json` (Chrome trace) and `DIR/NAME.png` (`plot_trace`), then `PROFILE
    path`. Every rank profiles, so the step is the same collective on all."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync()
    if not show:
        return
    os.makedirs(a.profile, exist_ok=True)
    trace = os.path.join(a.profile, a.profile_name + ".json")
    prof.export_chrome_trace(trace)
    try:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        plot_trace(trace, os.path.join(a.profile, a.profile_name + ".png"),
                   f"{title}, {name}, amp={a.amp}, batch {a.batch}")
    except Exception as exc:  # noqa: BLE001 - the trace is still there
        print(f"timeline plot failed: {exc}")
    print(f"PROFILE {trace}", flush=True)


def _mib(nbytes: Any) -> str:
    try:
        return f"{float(nbytes) / _MIB:.1f}"
    except (TypeError, ValueError):
        return "?"


def reset_peak(device: torch.device) -> None:
    """Starts the allocator's peak statistics afresh (after warm-up); nothing on CPU."""
    if device.type != "cuda":
        return
    with contextlib.suppress(Exception):  # the report is optional
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def device_used(device: torch.device) -> float | None:
    """Bytes in use on the device (total - free, every allocator and the context); None on CPU
    or where the driver does not say."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info()
        return float(total - free)
    except Exception:  # noqa: BLE001
        return None


def memory_line(label: str, device: torch.device, used_max: float | None,
                extra: dict[str, str] | None = None) -> str:
    """`MEMORY <label> peak_alloc_mib=.. peak_reserved_mib=.. device_used_mib=.. [extra]`.

    `used_max`: the largest `device_used` seen during the timed windows."""
    fields: dict[str, str] = {}
    if device.type != "cuda":
        fields = {"peak_alloc_mib": "n/a", "peak_reserved_mib": "n/a", "device_used_mib": "n/a"}
    else:
        for key, fn in (("peak_alloc_mib", torch.cuda.max_memory_allocated),
                        ("peak_reserved_mib", torch.cuda.max_memory_reserved)):
            try:
                fields[key] = _mib(fn())
            except Exception:  # noqa: BLE001
                fields[key] = "?"
        fields["device_used_mib"] = _mib(used_max) if used_max is not None else "?"
    fields.update(extra or {})
    return f"MEMORY {label} " + " ".join(f"{k}={v}" for k, v in fields.items())


def ringvod_memory(opt: Any, device: torch.device) -> dict[str, str]:
    """What ringvod holds besides the model: CuPy's pool (NCCL engine staging and outputs it
    allocates itself; outside torch's allocator), the NCCL engine's fusion buffer (allocated
    through torch for torch tensors, so inside `peak_alloc`), and the `DistributedOptimizer`'s
    gradient bucket buffers (torch tensors) and their number (`buckets_n`; 0 in per-gradient
    mode). `?` where a reading fails, `n/a` on CPU."""
    if device.type != "cuda":
        out = {k: "n/a" for k in ("cupy_pool_mib", "cupy_used_mib", "fusion_mib",
                                  "buckets_mib")}
        reducer = getattr(opt, "_hvd_reducer", None)
        out["buckets_n"] = str(len(getattr(reducer, "buckets", ()) or ()))
        return out
    out: dict[str, str] = {}
    cupy = sys.modules.get("cupy")
    try:
        pool = cupy.get_default_memory_pool()  # type: ignore[union-attr]
        out["cupy_pool_mib"] = _mib(pool.total_bytes())
        out["cupy_used_mib"] = _mib(pool.used_bytes())
    except Exception:  # noqa: BLE001 - CuPy not imported, or another API
        out["cupy_pool_mib"] = out["cupy_used_mib"] = "?"
    try:
        from collective import _current
        rt = _current.current_or_none()
        total, seen = 0, False
        for ps in (rt.member_sets() if rt is not None else []):
            eng = getattr(ps, "device_engine", None)
            if eng is None:
                continue
            n = getattr(eng, "_fusion_bytes", None)
            if n is not None:
                total += int(n)
                seen = True
        # No device engine yet (one process) holds nothing; an engine without the attribute: ?
        engines = [getattr(ps, "device_engine", None) for ps in
                   (rt.member_sets() if rt is not None else [])]
        out["fusion_mib"] = _mib(total) if seen or not any(engines) else "?"
    except Exception:  # noqa: BLE001
        out["fusion_mib"] = "?"
    try:
        reducer = getattr(opt, "_hvd_reducer", None)
        if reducer is None:
            out["buckets_mib"], out["buckets_n"] = "0.0", "0"  # the plain optimizer (1 process)
        else:
            total = 0
            for b in reducer.buckets:
                flat = getattr(b, "flat", None)
                if flat is not None:
                    total += flat.numel() * flat.element_size()
            out["buckets_mib"], out["buckets_n"] = _mib(total), str(len(reducer.buckets))
    except Exception:  # noqa: BLE001
        out["buckets_mib"] = out["buckets_n"] = "?"
    return out
