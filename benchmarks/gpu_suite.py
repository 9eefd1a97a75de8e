"""The GPU benchmarks, each with its same-run baseline; called by `benchmarks/run_gpu_suite.sh`.

`run_gpu_suite.sh` prepares the environment (the NCCL multicast switches off, MPI found or
installed from carried wheels) and then runs one of these parts::

    python3 benchmarks/gpu_suite.py sweep  [--gpus 2] [--quick]
    python3 benchmarks/gpu_suite.py resnet [--gpus 2] [--configs fp32,bf16] [--rounds 2]
                                           [--one-gpu] [--iters 90]
    python3 benchmarks/gpu_suite.py timeline

* `sweep`: float32 allreduce 1 KiB – 1 GiB at N GPUs (`gpu_allreduce.py` under
  `mpirun -np N`): ringvod vs raw CuPy NCCL vs torch.distributed in the same processes, then a
  lone synchronous op of 1 KiB, 64 KiB and 1 MiB; `allreduce_<N>gpu.json` and `.png`.
* `resnet`: ResNet-50 synthetic training, batch 64/GPU, ringvod (`gpu_resnet.py`) vs PyTorch
  DDP (`ddp_resnet.py` under `torch.distributed.run`) at N GPUs, the two alternating (the first
  of each round alternates) for `--rounds` rounds per configuration: fp32, bf16 (autocast),
  `fp32+fp16` and `bf16+bf16` (with gradient compression; DDP uses its compress hooks).
  `--one-gpu` first runs each configuration at 1 GPU (both) for the scaling efficiency.
  Each run is the median of 3 timed windows after 15 warm-up steps; the table gives every run
  and the ratio of the medians; `resnet.json`.
* `timeline`: one profiled ringvod training step at 2 GPUs (`timeline_step.png` and the Chrome
  trace `timeline_step.json.gz`).

Results go to $OUT (default ./out) with `suite.log` (every command and its output). Each step
has a timeout and the whole part a budget (`--budget`), so a device call ends in time.
"""
from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _report import format_table, write_results  # noqa: E402

PY = sys.executable
_RESULT = re.compile(r"RESULT impl=(\S+) world=(\d+) amp=(\w+) compression=(\w+) .*"
                     r"img_per_sec_total=([\d.]+)")
CONFIGS = {  # label -> (amp, compression)
    "fp32": (False, "none"), "bf16": (True, "none"),
    "fp32+fp16": (False, "fp16"), "bf16+bf16": (True, "bf16"),
}


class Suite:
    """Runs commands with timeouts inside an overall budget and logs them to $OUT/suite.log."""

    def __init__(self, out: str, budget: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget
        self.log = open(os.path.join(out, "suite.log"), "a", buffering=1)
        self.failures = 0  # runs that gave no result; two in a row end the part
        self.mpirun = os.environ.get("RINGVOD_MPIRUN", "mpirun --allow-run-as-root "
                                     "--bind-to none").split()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def run(self, cmd: list[str], timeout: float, env: dict | None = None) -> str:
        timeout = min(timeout, max(self.left(), 1.0))
        self.log.write(f"$ {' '.join(cmd)}\n")
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **(env or {})),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
            out, note = p.stdout, f"rc={p.returncode}"
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            note = f"TIMEOUT after {timeout:.0f}s"
        self.log.write(out)
        self.log.write(f"[{note}, {time.monotonic() - t:.1f}s]\n")
        if note != "rc=0":
            self.say(f"!! {' '.join(cmd[-6:])}: {note}\n" + "\n".join(out.splitlines()[-15:]))
        return out

    def mpi(self, np_: int, args: list[str]) -> list[str]:
        """`mpirun -np N python -u ARGS`, passing the NCCL switches and HOROVOD_* on."""
        xs = []
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                  "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"):
            if k in os.environ:
                xs += ["-x", k]
        xs += [x for k in os.environ if k.startswith("HOROVOD_") for x in ("-x", k)]
        return self.mpirun + ["-np", str(np_)] + xs + [PY, "-u"] + args


def parse(text: str) -> list[dict]:
    """The `RESULT ...` lines of gpu_resnet.py / ddp_resnet.py as rows."""
    rows = []
    for m in _RESULT.finditer(text):
        impl, world, amp, comp, ips = m.groups()
        rows.append({"series": impl, "gpus": int(world), "amp": amp == "True",
                     "compression": comp, "throughput": float(ips)})
    return rows


# -- allreduce sweep ---------------------------------------------------------------------------
def sweep(s: Suite, n: int, quick: bool = False) -> None:
    s.say(f"== allreduce sweep, {n} GPUs: ringvod vs CuPy NCCL vs torch.distributed")
    args = [os.path.join(HERE, "gpu_allreduce.py"), "--lone-sizes", "1024,65536,1048576",
            "--json", os.path.join(s.out, f"allreduce_{n}gpu.json"),
            "--png", os.path.join(s.out, f"allreduce_{n}gpu.png")]
    if quick:
        args += ["--quick", "--max-bytes", str(1 << 28)]
    out = s.run(s.mpi(n, args), 300)
    s.say("\n".join(line for line in out.splitlines() if not line.startswith("[")))


# -- ResNet-50 vs DDP --------------------------------------------------------------------------
def resnet_run(s: Suite, n: int, impl: str, cfg: str, iters: int) -> float | None:
    """One ResNet-50 run of `impl` (ringvod or DDP) at `n` GPUs; img/s or None."""
    amp, comp = CONFIGS[cfg]
    flags = ["--iters", str(iters), "--warmup", "15", "--repeats", "3",
             "--compression", comp] + (["--amp"] if amp else [])
    script = os.path.join(HERE, "gpu_resnet.py" if impl == "ringvod" else "ddp_resnet.py")
    if n == 1:
        cmd = [PY, "-u", script] + flags
    elif impl == "ringvod":
        cmd = s.mpi(n, [script] + flags)
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               script] + flags
    rows = parse(s.run(cmd, 150))
    if not rows:
        s.failures += 1
        if s.failures >= 2:
            s.deadline = 0.0  # two runs without a result: stop rather than spend the budget
        return None
    s.failures = 0
    v = rows[-1]["throughput"]
    s.say(f"-- {n} GPU(s) {cfg} {impl}: {v:.0f} img/s")
    return v


def resnet(s: Suite, n: int, configs: list[str], rounds: int, iters: int,
           one_gpu: bool) -> list[dict]:
    rows = []
    if one_gpu:
        for cfg in configs:
            for impl in ("ringvod", "DDP"):
                rows.append({"gpus": 1, "config": cfg, "impl": impl, "round": 1,
                             "img_s": resnet_run(s, 1, impl, cfg, iters)})
    for rnd in range(1, rounds + 1):
        for cfg in configs:
            for impl in (("DDP", "ringvod") if rnd % 2 else ("ringvod", "DDP")):
                if s.left() < 30:
                    s.say(f"-- budget spent: skipping {cfg} {impl}, round {rnd}")
                    continue
                rows.append({"gpus": n, "config": cfg, "impl": impl, "round": rnd,
                             "img_s": resnet_run(s, n, impl, cfg, iters)})
    return rows


def resnet_table(s: Suite, rows: list[dict]) -> None:
    def med(n, cfg, impl):
        vals = [r["img_s"] for r in rows if r["gpus"] == n and r["config"] == cfg
                and r["impl"] == impl and r["img_s"]]
        return (statistics.median(vals) if vals else None), vals

    out = []
    for cfg in CONFIGS:
        for n in sorted({r["gpus"] for r in rows}):
            (rv, rvs), (dd, dds) = med(n, cfg, "ringvod"), med(n, cfg, "DDP")
            if rv is None and dd is None:
                continue
            one_rv, one_dd = med(1, cfg, "ringvod")[0], med(1, cfg, "DDP")[0]

            def eff(v, one):
                return f"{v / (n * one) * 100:.0f}%" if v and one and n > 1 else ""
            out.append([cfg, n, "/".join(f"{v:.0f}" for v in rvs),
                        "/".join(f"{v:.0f}" for v in dds), f"{rv / dd:.3f}" if rv and dd else "",
                        eff(rv, one_rv), eff(dd, one_dd)])
    s.say("ResNet-50 synthetic, batch 64/GPU, img/s (every run; ratio of medians):")
    s.say(format_table(["config", "GPUs", "ringvod", "DDP", "ringvod/DDP", "eff ringvod",
                        "eff DDP"], out))


# -- one profiled step -------------------------------------------------------------------------
def timeline(s: Suite) -> None:
    s.say("== one profiled ringvod step (fp32, 2 GPUs)")
    out = s.run(s.mpi(2, [os.path.join(HERE, "gpu_resnet.py"), "--iters", "10", "--warmup",
                          "10", "--profile", s.out]), 150)
    trace = os.path.join(s.out, "timeline_step.json")
    if os.path.exists(trace):
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
        s.say("\n".join(ln for ln in out.splitlines() if ln.startswith("TRACE")))
        s.say("timeline: timeline_step.png, timeline_step.json.gz (chrome://tracing)")
    else:
        s.say("timeline: no trace written\n" + "\n".join(out.splitlines()[-10:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["sweep", "resnet", "timeline"])
    p.add_argument("--gpus", type=int, default=2, help="GPUs for the sweep / ResNet-50")
    p.add_argument("--quick", action="store_true", help="sweep: up to 256 MiB, fewer iterations")
    p.add_argument("--configs", default="fp32,bf16",
                   help=f"resnet: comma list of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=2, help="resnet: alternating rounds")
    p.add_argument("--one-gpu", action="store_true", help="resnet: 1-GPU runs too (scaling)")
    p.add_argument("--iters", type=int, default=90, help="resnet: timed steps (3 windows)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole part")
    a = p.parse_args()
    out = os.environ.get("OUT") or os.path.join(REPO, "out")
    os.makedirs(out, exist_ok=True)
    s = Suite(out, a.budget)
    if a.part == "sweep":
        sweep(s, a.gpus, a.quick)
    elif a.part == "timeline":
        timeline(s)
    else:
        configs = [c for c in a.configs.split(",") if c]
        unknown = set(configs) - set(CONFIGS)
        if unknown:
            p.error(f"unknown --configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
        rows = resnet(s, a.gpus, configs, a.rounds, a.iters, a.one_gpu)
        write_results(os.path.join(out, "resnet.json"), "gpu_resnet", rows,
                      params={"batch": 64, "iters": a.iters, "gpus": a.gpus,
                              "rounds": a.rounds})
        resnet_table(s, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
