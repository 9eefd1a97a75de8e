"""Runs the GPU benchmark suite in one go (one device call) and prints a short table last.

Called by `benchmarks/run_gpu_suite.sh`, which prepares the environment (MPI, NCCL settings).
Steps, each with its own timeout, skipped once the overall budget is spent:

* `allreduce`: `baselines/nccl_bw.py` (the team's raw-NCCL reference) and `gpu_allreduce.py`
  (ringvod vs CuPy NCCL vs torch.distributed in the same processes);
* `resnet`: ResNet-50 synthetic training, ringvod vs DDP, fp32 and bf16 autocast, with and
  without gradient compression, at 1 and 2 GPUs (1-GPU runs of the two go side by side on the
  two GPUs, alternating which gets which);
* `timeline`: one profiled ringvod training step (Chrome trace and PNG).

Everything lands in $OUT: suite.log, allreduce.json/.png, nccl_bw.json, resnet.json,
resnet_scaling.png, timeline_step.png, timeline_step.json.gz.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
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


class Suite:
    def __init__(self, out: str, budget: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget
        self.log = open(os.path.join(out, "suite.log"), "a", buffering=1)
        self.failures = 0  # runs that gave no result (final_runs stops after two)
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
            out = p.stdout
            note = f"rc={p.returncode}"
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            note = f"TIMEOUT after {timeout:.0f}s"
        self.log.write(out)
        self.log.write(f"[{note}, {time.monotonic() - t:.1f}s]\n")
        if "rc=0" not in note:
            self.say(f"!! {' '.join(cmd[-6:])}: {note}\n" + "\n".join(out.splitlines()[-15:]))
        return out

    def mpi(self, np_: int, args: list[str]) -> list[str]:
        xs = []
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                  "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"):
            if k in os.environ:
                xs += ["-x", k]
        for k in os.environ:
            if k.startswith("HOROVOD_"):
                xs += ["-x", k]
        return self.mpirun + ["-np", str(np_)] + xs + [PY, "-u"] + args


def parse(text: str) -> list[dict]:
    rows = []
    for m in _RESULT.finditer(text):
        impl, world, amp, comp, ips = m.groups()
        rows.append({"series": "DDP" if impl == "DDP" else impl, "gpus": int(world),
                     "amp": amp == "True", "compression": comp, "throughput": float(ips)})
    return rows


def allreduce(s: Suite, quick: bool) -> None:
    if not quick:
        s.say("== raw NCCL reference (baselines/nccl_bw.py)")
        out = s.run([PY, os.path.join(HERE, "baselines", "nccl_bw.py")], 150)
        s.say("\n".join(out.splitlines()[-12:]))
    s.say("== allreduce: ringvod vs CuPy NCCL vs torch.distributed")
    args = [os.path.join(HERE, "gpu_allreduce.py"), "--json", os.path.join(s.out, "allreduce.json"),
            "--png", os.path.join(s.out, "allreduce.png")]
    if quick:
        args += ["--quick", "--max-bytes", str(1 << 28), "--lone-sizes", "4096"]
    out = s.run(s.mpi(2, args), 200)
    s.say("\n".join(line for line in out.splitlines() if not line.startswith("[")))


def one_gpu_pair(s: Suite, flags: list[str], gpus: tuple[str, str]) -> list[dict]:
    """Runs ringvod (gpus[0]) and DDP (gpus[1]) at 1 GPU each, side by side."""
    procs = []
    for script, gpu in (("gpu_resnet.py", gpus[0]), ("ddp_resnet.py", gpus[1])):
        cmd = [PY, "-u", os.path.join(HERE, script)] + flags
        s.log.write(f"$ CUDA_VISIBLE_DEVICES={gpu} {' '.join(cmd)}\n")
        procs.append(subprocess.Popen(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT,
                                      env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)))
    rows: list[dict] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=min(150, max(s.left(), 1)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        s.log.write(out)
        rows += parse(out)
    return rows


def resnet(s: Suite, configs: list[tuple], iters: int, repeats: int, one_gpu: bool,
           variants: list[tuple[str, dict]]) -> list[dict]:
    rows: list[dict] = []
    common = ["--iters", str(iters), "--warmup", "15", "--repeats", str(repeats)]
    for amp, comp in configs:
        flags = common + (["--amp"] if amp else []) + ["--compression", comp]
        label = f"{'bf16-amp' if amp else 'fp32'} comp={comp}"
        if s.left() < 60:
            s.say(f"-- budget spent, skipping {label}")
            break
        if one_gpu and comp == "none":
            # 1 GPU: ringvod and DDP side by side, one per GPU (alternating which gets which).
            rows += one_gpu_pair(s, flags, ("0", "1") if not amp else ("1", "0"))
        out = s.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     os.path.join(HERE, "ddp_resnet.py")] + flags, 150)
        rows += parse(out)
        for tag, env in variants:
            out = s.run(s.mpi(2, [os.path.join(HERE, "gpu_resnet.py")]
                              + (["--tag", tag] if tag else []) + flags), 150, env=env)
            rows += parse(out)
        got = [r for r in rows if r["amp"] == amp and r["compression"] == comp]
        s.say(f"-- {label}: " + ", ".join(f"{r['series']}@{r['gpus']}={r['throughput']:.0f}"
                                        for r in got))
    return rows


def timeline(s: Suite) -> None:
    s.say("== one profiled ringvod step")
    out = s.run(s.mpi(2, [os.path.join(HERE, "gpu_resnet.py"), "--iters", "10", "--warmup",
                          "10", "--profile", s.out]), 150)
    trace = os.path.join(s.out, "timeline_step.json")
    if os.path.exists(trace):
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
        s.say("timeline: timeline_step.png, timeline_step.json.gz (chrome://tracing)")
    else:
        s.say("timeline: no trace written\n" + "\n".join(out.splitlines()[-10:]))


def allreduce_summary(s: Suite) -> None:
    path = os.path.join(s.out, "allreduce.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        doc = json.load(f)
    pipe, lone = doc["results"]["pipelined"], doc["results"]["lone"]
    out = []
    for nb in sorted({r["bytes"] for r in pipe}):
        by = {r["series"]: r for r in pipe if r["bytes"] == nb}
        rv, cp, td = by["ringvod"], by["CuPy NCCL"], by["torch.distributed"]
        out.append([f"{nb >> 10} KiB" if nb < 1 << 20 else f"{nb >> 20} MiB",
                    f"{rv['time_us']:.0f}", f"{rv['busbw_gbs']:.1f}", f"{cp['busbw_gbs']:.1f}",
                    f"{td['busbw_gbs']:.1f}", f"{rv['busbw_gbs'] / max(cp['busbw_gbs'], 1e-9):.2f}"])
    s.say(f"allreduce float32, 2x {doc['params'].get('device', '?')} (busbw GB/s):")
    s.say(format_table(["size", "ringvod us", "ringvod", "CuPy NCCL", "torch", "rv/raw"], out))
    lt = [[f"{r['bytes'] >> 10} KiB", r["series"], f"{r['lone_us']:.1f}"] for r in lone]
    s.say("lone sync allreduce (median us):  " + "; ".join(f"{a} {b} {c}" for a, b, c in lt))


def table(s: Suite, rows: list[dict]) -> None:
    if not rows:
        return
    out = []
    keys = sorted({(r["amp"], r["compression"]) for r in rows})
    for amp, comp in keys:
        sel = [r for r in rows if r["amp"] == amp and r["compression"] == comp]
        ddp = {r["gpus"]: r["throughput"] for r in sel if r["series"] == "DDP"}
        for series in sorted({r["series"] for r in sel}):
            by = {r["gpus"]: r["throughput"] for r in sel if r["series"] == series}
            one, two = by.get(1), by.get(2)
            ratio = f"{two / ddp[2]:.3f}" if two and ddp.get(2) and series != "DDP" else ""
            eff = f"{two / (2 * one) * 100:.0f}%" if one and two else ""
            out.append([f"{'bf16' if amp else 'fp32'}/{comp}", series,
                        f"{one:.0f}" if one else "", f"{two:.0f}" if two else "", eff, ratio])
    s.say("ResNet-50 synthetic, batch 64/GPU, img/s (median of windows):")
    s.say(format_table(["config", "impl", "1 GPU", "2 GPUs", "scaling", "vs DDP"], out))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["smoke", "full", "diag", "probe", "final2"])
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps")
    a = p.parse_args()
    out = os.environ.get("OUT") or os.path.join(REPO, "out")
    os.makedirs(out, exist_ok=True)
    s = Suite(out, a.budget)
    rows: list[dict] = []
    if a.mode == "final2":
        # ringvod (default gradient buckets) vs DDP at 2 GPUs, fp32 and bf16 autocast, then
        # 1 GPU side by side for scaling efficiency; all in one call.
        ddp = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(HERE, "ddp_resnet.py"), "--iters", "40", "--repeats", "3", "--phases"]
        rv = [os.path.join(HERE, "gpu_resnet.py"), "--iters", "40", "--repeats", "3", "--phases"]
        for cmd in (ddp, s.mpi(2, rv), ddp + ["--amp"], s.mpi(2, rv + ["--amp"])):
            out = s.run(cmd, 120)
            rows += parse(out)
            s.say("\n".join(ln for ln in out.splitlines() if ln.startswith(("RESULT", "PHASES"))))
        if s.left() > 60:  # 1 GPU: ringvod and DDP side by side, one per GPU
            pair = one_gpu_pair(s, ["--iters", "40", "--warmup", "15", "--repeats", "3"],
                                ("0", "1"))
            rows += pair
            s.say("\n".join(f"RESULT {r}" for r in pair))
        table(s, rows)
        if rows:
            write_results(os.path.join(out, "resnet.json"), "gpu_resnet", rows,
                          params={"batch": 64, "mode": a.mode})
        return 0
    if a.mode == "probe":
        ddp = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(HERE, "ddp_resnet.py"), "--iters", "40", "--repeats", "2", "--phases"]
        rv = [os.path.join(HERE, "gpu_resnet.py"), "--iters", "40", "--repeats", "2", "--phases"]
        for cmd in (ddp, s.mpi(2, rv), s.mpi(2, rv + ["--groups", "10", "--tag=-groups10"]),
                    ddp + ["--amp"], s.mpi(2, rv + ["--amp"]),
                    s.mpi(2, rv + ["--amp", "--groups", "10", "--tag=-groups10"])):
            out = s.run(cmd, 120)
            s.say("\n".join(ln for ln in out.splitlines()
                             if ln.startswith(("RESULT", "PHASES", "TRACE", "PROFILE"))))
        return 0
    if a.mode == "diag":
        allreduce(s, quick=True)
        rows = resnet(s, [(False, "none"), (True, "none")], iters=40, repeats=2, one_gpu=False,
                      variants=[])
        s.say("== diag (mpi)")
        out = s.run(s.mpi(2, [os.path.join(HERE, "gpu_diag.py")]), 200)
        s.say("\n".join(line for line in out.splitlines() if "DIAG" in line))
        s.say("== diag (tcp, hvdrun)")
        out = s.run([PY, "-m", "launcher", "-np", "2", "--tcp", PY, "-u",
                     os.path.join(HERE, "gpu_diag.py"), "default,nospin+switch100us"], 150)
        s.say("\n".join(line for line in out.splitlines() if "DIAG" in line))
    elif a.mode == "smoke":
        allreduce(s, quick=True)
        rows = resnet(s, [(False, "none"), (True, "none")], iters=40, repeats=2, one_gpu=False,
                      variants=[("", {}), ("-cyc5", {"HOROVOD_CYCLE_TIME": "5"})])
    else:
        allreduce(s, quick=False)
        rows = resnet(s, [(False, "none"), (True, "none"), (False, "fp16"), (True, "bf16")],
                      iters=90, repeats=3, one_gpu=True, variants=[("", {})])
        if s.left() > 45:
            timeline(s)
    if rows:
        write_results(os.path.join(out, "resnet.json"), "gpu_resnet", rows,
                      params={"batch": 64, "mode": a.mode})
        try:
            from _report import plot_scaling
            base = [r for r in rows if not r["amp"] and r["compression"] == "none"]
            if any(r["gpus"] == 1 for r in base):
                plot_scaling(base, os.path.join(out, "resnet_scaling.png"),
                             title="ResNet-50 fp32, batch 64/GPU")
        except Exception as exc:  # noqa: BLE001 - the table is the result
            s.say(f"plot failed: {exc}")
    allreduce_summary(s)
    table(s, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
