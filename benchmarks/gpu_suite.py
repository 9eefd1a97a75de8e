"""The GPU benchmarks, each with its same-run baseline; called by `benchmarks/run_gpu_suite.sh`.

`run_gpu_suite.sh` prepares the environment (the NCCL multicast switches off, MPI found or
installed from carried wheels) and then runs one of these parts::

    python3 benchmarks/gpu_suite.py sweep  [--gpus 2] [--quick]
    python3 benchmarks/gpu_suite.py resnet [--gpus 2] [--configs fp32,bf16] [--rounds 2]
                                           [--one-gpu] [--iters 90] [--model transformer]
    python3 benchmarks/gpu_suite.py phases [--gpus 2] [--configs fp32] [--cycles 1,2.5,10]
                                           [--rounds 1] [--model resnet50]
    python3 benchmarks/gpu_suite.py timeline [--gpus 2] [--configs fp32] [--one-gpu]
    python3 benchmarks/gpu_suite.py ab --base REV|DIR [--gpus 2] [--configs fp32,bf16]
                                       [--rounds 2] [--ddp] [--model resnet50]

* `sweep`: float32 allreduce 1 KiB – 1 GiB at N GPUs (`gpu_allreduce.py` under
  `mpirun -np N`): ringvod vs raw CuPy NCCL vs torch.distributed in the same processes, then a
  lone synchronous op of 1 KiB, 64 KiB and 1 MiB; `allreduce_<N>gpu.json` and `.png`.
* `resnet`: synthetic training of `--model resnet50` (batch 64/GPU, img/s) or `transformer`
  (BERT-base-shaped encoder of 154 parameter tensors, batch 32 x 128 tokens/GPU, samples/s;
  `_models.py`), ringvod (`gpu_resnet.py`) vs PyTorch DDP (`ddp_resnet.py` under
  `torch.distributed.run`) at N GPUs, the two alternating (the first of each round alternates)
  for `--rounds` rounds per configuration: fp32, bf16 (autocast), `fp32+fp16` and `bf16+bf16`
  (with gradient compression; DDP uses its compress hooks); a `+pg` suffix (`fp32+pg`,
  `bf16+pg`, ...) runs ringvod in Horovod's per-gradient mode (`HOROVOD_BUCKET_CAP_MB=0`: one
  allreduce per gradient, fused by the runtime, instead of buckets), DDP unchanged.
  `--one-gpu` first runs each configuration at 1 GPU (both) for the scaling efficiency.
  Each run is the median of 3 timed windows after 15 warm-up steps; the table gives every run
  and the ratio of the medians, then a memory table (peak of torch's allocator after warm-up,
  reserved, device used memory; for ringvod its CuPy pool, fusion buffer and gradient
  buckets); `resnet.json` (`transformer.json` for the transformer).
* `phases`: where a training step goes: DDP, ringvod with buckets and ringvod in per-gradient
  mode at each `--cycles` cycle time (`HOROVOD_CYCLE_TIME`), each run with `--phases` (host
  time of forward, backward and step, and the GPU's tail after step, median of 20 steps); the
  variants alternate direction per round; `phases_<model>.json`.
* `ab`: is a change faster? Paired training runs of this checkout's library ("current") and
  another ("base": a git revision, exported with `git archive` into $OUT, or a folder holding a
  copy of `collective/`, `frameworks/`, `horovod/` and `launcher/`, e.g. where git is missing),
  both ringvod, in the same environment but for `PYTHONPATH` (every run's `LIBRARY` line is
  checked against its side); which goes first alternates per round. `--ddp` adds a DDP run per
  round. The table gives each pair's ratio current ÷ base, their median, the ratio of the summed
  throughputs and the pairs' spread: a change earns its place only if it beats the base by more
  than that spread (give it five rounds or more: `run_gpu_suite.sh ab` runs five); `ab.json` has
  every run.
* `timeline`: one profiled training step per configuration, ringvod and DDP at N GPUs (with
  `--one-gpu` ringvod at 1 GPU too), each run also timed with its host time per step phase:
  `timeline_<model>_<config>_<impl>_<N>gpu.png` (kernels per stream, NCCL in red) and the
  Chrome trace `.json.gz`.

Results go to $OUT (default ./out) with `suite.log` (every command and its output). Each step
has a timeout and the whole part a budget (`--budget`), so a device call ends in time.
"""
from __future__ import annotations

import argparse
import gzip
import io
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _report import format_table, write_results

PY = sys.executable
_RESULT = re.compile(r"RESULT impl=(\S+) world=(\d+) amp=(\w+) compression=(\w+) .*"
                     r"img_per_sec_total=([\d.]+)")
_MEMORY = re.compile(r"^MEMORY (.*)$", re.MULTILINE)
_LIBRARY = re.compile(r"^LIBRARY (.+)$", re.MULTILINE)
_PHASES = re.compile(r"^PHASES .*: forward ([\d.]+) ms, backward ([\d.]+) ms, step ([\d.]+) ms, "
                     r"gpu tail ([\d.]+) ms", re.MULTILINE)
CONFIGS = {  # label -> (amp, compression); each also with "+pg" (ringvod per gradient)
    "fp32": (False, "none"), "bf16": (True, "none"),
    "fp32+fp16": (False, "fp16"), "bf16+bf16": (True, "bf16"),
}
PG = "+pg"
MODELS = {  # --model -> (title, unit, seconds a run may take, budget kept back per run)
    "resnet50": ("ResNet-50 synthetic, batch 64/GPU", "img/s", 150, 30),
    "transformer": (("Transformer encoder (BERT-base shape, 154 parameter tensors) synthetic, "
                     "batch 32 x 128 tokens/GPU"), "samples/s", 180, 45),
}


def config_of(label: str) -> tuple[bool, str, bool]:
    """(amp, compression, per_gradient) of a config label such as `bf16+pg`.

    Raises:
        KeyError: unknown label.
    """
    pg = label.endswith(PG)
    amp, comp = CONFIGS[label[:-len(PG)] if pg else label]
    return amp, comp, pg


class Suite:
    """Runs commands with timeouts inside an overall budget and logs them to $OUT/suite.log."""

    def __init__(self, out: str, budget: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget
        self.log = open(os.path.join(out, "suite.log"), "a", buffering=1)  # noqa: SIM115
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
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self.log.write(f"$ {shown + ' ' if shown else ''}{' '.join(cmd)}\n")
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, check=False, cwd=REPO, env=dict(os.environ, **(env or {})),
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

    def mpi(self, np_: int, args: list[str], env: dict | None = None) -> list[str]:
        """`mpirun -np N python -u ARGS`, passing the NCCL switches, HOROVOD_* and the keys of
        `env` (the per-run environment given to `run`, which mpirun then has) on."""
        keys = [k for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                            "NVSHMEM_DISABLE_NVLS", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH")
                if k in os.environ]
        keys += [k for k in os.environ if k.startswith("HOROVOD_")]
        keys += list(env or {})
        xs = [x for k in dict.fromkeys(keys) for x in ("-x", k)]
        return self.mpirun + ["-np", str(np_)] + xs + [PY, "-u"] + args


def parse(text: str) -> list[dict]:
    """The `RESULT ...` lines of gpu_resnet.py / ddp_resnet.py as rows."""
    rows = []
    for m in _RESULT.finditer(text):
        impl, world, amp, comp, ips = m.groups()
        rows.append({"series": impl, "gpus": int(world), "amp": amp == "True",
                     "compression": comp, "throughput": float(ips)})
    return rows


def parse_memory(text: str) -> dict:
    """The last `MEMORY k=v ...` line as {k: float or the text}, without impl/world/model;
    {} when there is none."""
    found = _MEMORY.findall(text)
    if not found:
        return {}
    out: dict = {}
    for item in found[-1].split():
        k, sep, v = item.partition("=")
        if not sep or k in ("impl", "world", "model"):
            continue
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return out


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


# -- ResNet-50 / transformer vs DDP -----------------------------------------------------------
def train_run(s: Suite, n: int, impl: str, cfg: str, iters: int, model: str = "resnet50",
              extra: list[str] | None = None, env_extra: dict | None = None,
              label: str | None = None) -> tuple[float | None, dict]:
    """One training run of `impl` (ringvod or DDP) at `n` GPUs: (samples/s or None, the MEMORY
    line's fields, plus `phases` (forward, backward, step, GPU tail in ms) when the script
    printed a PHASES line, and `trace`, its TRACE lines, when it profiled). `extra`: more
    arguments for the script (later ones win); `env_extra`: more environment for ringvod's
    ranks (e.g. HOROVOD_CYCLE_TIME); `label`: how the progress line names the run (default:
    `impl`)."""
    amp, comp, pg = config_of(cfg)
    flags = ["--model", model, "--iters", str(iters), "--warmup", "15", "--repeats", "3",
             "--compression", comp] + (["--amp"] if amp else []) + list(extra or [])
    script = os.path.join(HERE, "gpu_resnet.py" if impl == "ringvod" else "ddp_resnet.py")
    env = {"HOROVOD_BUCKET_CAP_MB": "0"} if pg and impl == "ringvod" else None
    if env_extra and impl == "ringvod":
        env = dict(env or {}, **env_extra)
    if n == 1:
        cmd = [PY, "-u", script] + flags
    elif impl == "ringvod":
        cmd = s.mpi(n, [script] + flags, env)
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               script] + flags
    # A compiled model's first step compiles it (a minute or two for ResNet-50).
    out = s.run(cmd, MODELS[model][2] + (240 if "--compile" in flags else 0), env)
    rows = parse(out)
    if not rows:
        s.failures += 1
        if s.failures >= 2:
            s.deadline = 0.0  # two runs without a result: stop rather than spend the budget
        return None, {}
    s.failures = 0
    v = rows[-1]["throughput"]
    s.say(f"-- {n} GPU(s) {cfg} {label or impl}: {v:.0f} {MODELS[model][1]}")
    mem = parse_memory(out)
    ph = _PHASES.findall(out)
    if ph:
        mem["phases"] = [float(x) for x in ph[-1]]
    trace = [ln for ln in out.splitlines() if ln.startswith("TRACE")]
    if trace:
        mem["trace"] = trace
    lib = _LIBRARY.findall(out)
    if lib:
        mem["library"] = lib[-1].strip()
    return v, mem


def resnet_run(s: Suite, n: int, impl: str, cfg: str, iters: int,
               model: str = "resnet50") -> float | None:
    """One run's throughput (img/s for ResNet-50) or None; see `train_run`."""
    return train_run(s, n, impl, cfg, iters, model)[0]


def resnet(s: Suite, n: int, configs: list[str], rounds: int, iters: int,
           one_gpu: bool, model: str = "resnet50", extra: list[str] | None = None) -> list[dict]:
    rows = []
    keep = MODELS[model][3]

    def one(gpus: int, cfg: str, impl: str, rnd: int) -> None:
        v, mem = train_run(s, gpus, impl, cfg, iters, model, extra)
        rows.append({"gpus": gpus, "config": cfg, "impl": impl, "round": rnd, "model": model,
                     "img_s": v, "memory": mem})

    if one_gpu:
        for cfg in configs:
            for impl in ("ringvod", "DDP"):
                if s.left() < keep:
                    s.say(f"-- budget spent: skipping 1 GPU {cfg} {impl}")
                    continue
                one(1, cfg, impl, 1)
    for rnd in range(1, rounds + 1):
        for cfg in configs:
            for impl in (("DDP", "ringvod") if rnd % 2 else ("ringvod", "DDP")):
                if s.left() < keep:
                    s.say(f"-- budget spent: skipping {cfg} {impl}, round {rnd}")
                    continue
                one(n, cfg, impl, rnd)
    return rows


def resnet_table(s: Suite, rows: list[dict], model: str = "resnet50") -> None:
    def med(n, cfg, impl):
        vals = [r["img_s"] for r in rows if r["gpus"] == n and r["config"] == cfg
                and r["impl"] == impl and r["img_s"]]
        return (statistics.median(vals) if vals else None), vals

    configs = list(dict.fromkeys(r["config"] for r in rows))
    out = []
    for cfg in configs:
        for n in sorted({r["gpus"] for r in rows}):
            (rv, rvs), (dd, dds) = med(n, cfg, "ringvod"), med(n, cfg, "DDP")
            if rv is None and dd is None:
                continue
            one_rv, one_dd = med(1, cfg, "ringvod")[0], med(1, cfg, "DDP")[0]

            def eff(v, one, n=n):
                return f"{v / (n * one) * 100:.0f}%" if v and one and n > 1 else ""
            out.append([cfg, n, "/".join(f"{v:.0f}" for v in rvs),
                        "/".join(f"{v:.0f}" for v in dds), f"{rv / dd:.3f}" if rv and dd else "",
                        eff(rv, one_rv), eff(dd, one_dd)])
    title, unit = MODELS[model][:2]
    s.say(f"{title}, {unit} (every run; ratio of medians; +pg: ringvod per gradient):")
    s.say(format_table(["config", "GPUs", "ringvod", "DDP", "ringvod/DDP", "eff ringvod",
                        "eff DDP"], out))
    memory_table(s, rows, configs)


_MEM_COLS = (("peak_alloc_mib", "peak alloc"), ("peak_reserved_mib", "reserved"),
             ("device_used_mib", "device used"), ("cupy_pool_mib", "CuPy pool"),
             ("fusion_mib", "fusion buf"), ("buckets_mib", "buckets"))


def memory_table(s: Suite, rows: list[dict], configs: list[str]) -> None:
    """MiB per config, GPU count and impl: the largest reading over its runs (rank 0)."""
    out = []
    for cfg in configs:
        for n in sorted({r["gpus"] for r in rows}):
            for impl in ("ringvod", "DDP"):
                mems = [r["memory"] for r in rows if r["gpus"] == n and r["config"] == cfg
                        and r["impl"] == impl and r.get("memory")]
                if not mems:
                    continue
                line = [cfg, n, impl]
                for key, _ in _MEM_COLS:
                    nums = [m[key] for m in mems if isinstance(m.get(key), float)]
                    texts = {str(m[key]) for m in mems
                             if key in m and not isinstance(m[key], float)}
                    line.append(f"{max(nums):.0f}" if nums
                                else ("" if not texts else "/".join(sorted(texts))))
                out.append(line)
    if not out:
        s.say("memory: no MEMORY lines")
        return
    s.say("GPU memory of rank 0, MiB (the largest over the runs; peak alloc/reserved: torch's "
          "allocator after warm-up; device used: total - free, the CUDA context, NCCL and "
          "CuPy included; CuPy pool, fusion buffer (inside torch's allocator) and buckets: "
          "ringvod's own):")
    s.say(format_table(["config", "GPUs", "impl"] + [h for _, h in _MEM_COLS], out))


# -- A/B of two libraries ----------------------------------------------------------------------
LIBRARY = ("collective", "frameworks", "horovod", "launcher")


def base_library(base: str, out: str) -> tuple[str, str]:
    """(the folder holding the base library, how the log names it): `base` itself when it is
    a folder, else git revision `base` of this checkout exported into `out` (named with the
    commit it resolved to).

    Raises:
        ValueError: `base` is neither such a folder nor a revision git can export, is both, or
            is this checkout.
    """
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", "-q", "--short",
                              base + "^{commit}"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except OSError:  # no git here: a folder is the only kind of base
        rev = ""
    if os.path.isdir(base):
        if rev:
            raise ValueError(f"--base {base}: both a folder and a git revision; write ./{base} "
                             f"for the folder or {base}^{{commit}} for the revision")
        missing = [d for d in LIBRARY if not os.path.isdir(os.path.join(base, d))]
        if missing:
            raise ValueError(f"--base {base}: no {', '.join(missing)} in that folder")
        if os.path.realpath(base) == os.path.realpath(REPO):
            raise ValueError(f"--base {base}: that is this checkout")
        return os.path.abspath(base), base
    try:
        p = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", base, *LIBRARY],
                           capture_output=True, check=False)
    except OSError as exc:
        raise ValueError(f"--base {base}: not a folder, and git cannot run here ({exc})") from exc
    if p.returncode:
        raise ValueError(f"--base {base}: neither a folder nor a revision git can export "
                         f"({p.stderr.decode(errors='replace').strip()})")
    dest = os.path.abspath(os.path.join(out, "ab_base_" + re.sub(r"[^\w.-]", "_", base)))
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
        # The "data" filter (no links out of the folder, no devices) where Python has it.
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return dest, f"{base} ({rev})"


def ab(s: Suite, n: int, configs: list[str], rounds: int, iters: int, base: str,
       model: str = "resnet50", extra: list[str] | None = None, ddp: bool = False
       ) -> list[dict]:
    """Paired runs of `base`'s library and this checkout's (see the module docstring); rows
    per run, and a table per configuration. Every ringvod run prints the folder it imported
    the library from (`LIBRARY`); a run that imported the other side's stops the part."""
    path = os.environ.get("PYTHONPATH", "")
    sides = {"base": {"PYTHONPATH": os.pathsep.join(x for x in (base, path) if x)},
             "current": {"PYTHONPATH": os.pathsep.join(x for x in (REPO, path) if x)}}
    expect = {"base": os.path.realpath(base), "current": os.path.realpath(REPO)}
    group = 2 + int(ddp)
    longest = float(MODELS[model][3])  # the longest run so far (at first: the margin per run)
    rows: list[dict] = []
    wrong = False  # a run imported the other side's library
    for rnd in range(1, rounds + 1):
        for cfg in configs:
            if wrong:
                break
            if s.left() < longest * group:  # a pair that cannot finish tells nothing
                s.say(f"-- budget spent: skipping {cfg}, round {rnd}")
                continue
            order = ["base", "current"] if rnd % 2 else ["current", "base"]
            for side in order + (["DDP"] if ddp else []):
                if s.left() <= 0:  # two failed runs end the part (train_run)
                    break
                impl = "DDP" if side == "DDP" else "ringvod"
                t0 = time.monotonic()
                v, mem = train_run(s, n, impl, cfg, iters, model, extra, sides.get(side),
                                   f"{impl} ({side}, round {rnd})" if impl != side else
                                   f"DDP (round {rnd})")
                longest = max(longest, time.monotonic() - t0)
                lib = mem.get("library")
                if v is not None and side in expect and (
                        lib is None or os.path.realpath(lib) != expect[side]):
                    s.say(f"!! the {side} run imported ringvod from {lib}, not "
                          f"{expect[side]}: stopping")
                    wrong, v = True, None
                rows.append({"gpus": n, "config": cfg, "side": side, "round": rnd,
                             "model": model, "img_s": v, "library": lib, "wrong_library": wrong,
                             "phases_ms": mem.get("phases")})
                if wrong:
                    break
    done = {(r["round"], r["config"], r["side"]) for r in rows if r["img_s"]}
    pairs = sum(1 for rnd, cfg, side in done if side == "base" and (rnd, cfg, "current") in done)
    s.say(f"-- {pairs} of {rounds * len(configs)} pairs completed")
    ab_table(s, rows, model)
    return rows


def ab_table(s: Suite, rows: list[dict], model: str = "resnet50") -> None:
    unit = MODELS[model][1]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        got = {(r["round"], r["side"]): r["img_s"] for r in rows if r["config"] == cfg}
        ddp = any(side == "DDP" for _, side in got)
        table, pairs = [], []
        for rnd in sorted({r for r, _ in got}):
            b, c, d = got.get((rnd, "base")), got.get((rnd, "current")), got.get((rnd, "DDP"))
            if b and c:
                pairs.append((b, c))
            line = [rnd, b or "-", c or "-", f"{c / b:.3f}" if b and c else "-"]
            table.append(line + ([f"{c / d:.3f}" if c and d else "-"] if ddp else []))
        s.say(f"\n{model} {cfg}, {rows[0]['gpus']} GPUs, {unit}: current vs base, per round")
        s.say(format_table(["round", "base", "current", "current/base"]
                           + (["current/DDP"] if ddp else []), table))
        if pairs:
            ratios = [c / b for b, c in pairs]
            summed = sum(c for _, c in pairs) / sum(b for b, _ in pairs)
            s.say(f"{cfg}: {len(pairs)} pairs, current/base median "
                  f"{statistics.median(ratios):.3f}, summed throughputs {summed:.3f}, pairs "
                  f"{min(ratios):.3f} to {max(ratios):.3f}")


# -- one profiled step -------------------------------------------------------------------------
def timeline(s: Suite, n: int, configs: list[str], model: str = "resnet50",
             one_gpu: bool = False, extra: list[str] | None = None) -> None:
    """One profiled training step per configuration: ringvod and DDP at `n` GPUs (and ringvod
    at 1 GPU with `one_gpu`), each run also timed (`--iters 30`) with its host time per step
    phase. Writes `timeline_<model>_<config>_<impl>_<n>gpu.png` and `.json.gz` (Chrome trace)
    and prints each run's `TRACE` lines (kernels and busy time per stream)."""
    runs = [(cfg, impl, k) for cfg in configs for impl, k in
            ([("ringvod", 1)] if one_gpu else []) + [("ringvod", n), ("DDP", n)]]
    for cfg, impl, k in runs:
        name = f"timeline_{model}_{cfg.replace('+', '_')}_{impl}_{k}gpu"
        s.say(f"== one profiled {model} {cfg} step, {impl}, {k} GPU(s)")
        v, mem = train_run(s, k, impl, cfg, 30, model,
                           list(extra or []) + ["--phases", "--profile", s.out,
                                                "--profile-name", name])
        trace = os.path.join(s.out, name + ".json")
        if os.path.exists(trace):
            with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(trace)
        lines = mem.get("trace", [])
        ph = mem.get("phases")
        s.say(f"{name}: {v or 0:.0f} {MODELS[model][1]}, host ms forward/backward/step/GPU "
              f"tail {'/'.join(f'{x:.1f}' for x in ph) if ph else '-'}; "
              f"{name}.png, {name}.json.gz" + "".join("\n  " + ln for ln in lines))


# -- where the step goes ------------------------------------------------------------------------
def phases(s: Suite, n: int, configs: list[str], cycles: list[float], rounds: int, iters: int,
           model: str = "resnet50", extra: list[str] | None = None) -> list[dict]:
    """Throughput and host time per step phase (`--phases`) of DDP, ringvod with buckets and
    ringvod in per-gradient mode at each cycle time, the variants alternating direction per
    round; a table per configuration."""
    variants: list[tuple[str, str, str, dict | None]] = []  # (config, label, impl, env)
    for cfg in dict.fromkeys(c.removesuffix(PG) for c in configs):
        variants += [(cfg, "DDP", "DDP", None), (cfg, "ringvod, buckets", "ringvod", None)]
        variants += [(cfg + PG, f"ringvod, per gradient, cycle {c:g} ms", "ringvod",
                      {"HOROVOD_CYCLE_TIME": f"{c:g}"}) for c in cycles]
    keep = MODELS[model][3]
    rows = []
    for rnd in range(1, rounds + 1):
        for cfg, label, impl, env in (variants if rnd % 2 else variants[::-1]):
            if s.left() < keep:
                s.say(f"-- budget spent: skipping {cfg} {label}, round {rnd}")
                continue
            v, mem = train_run(s, n, impl, cfg, iters, model, list(extra or []) + ["--phases"],
                               env)
            rows.append({"gpus": n, "config": cfg.removesuffix(PG), "variant": label,
                         "impl": impl, "round": rnd, "model": model, "img_s": v,
                         "phases_ms": mem.get("phases"), "env": env})
    unit = MODELS[model][1]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        table = []
        for label in dict.fromkeys(r["variant"] for r in rows if r["config"] == cfg):
            mine = [r for r in rows if r["config"] == cfg and r["variant"] == label]
            vals = [r["img_s"] for r in mine if r["img_s"] is not None]
            ph = [r["phases_ms"] for r in mine if r["phases_ms"]]
            med = [statistics.median(p[i] for p in ph) for i in range(4)] if ph else None
            table.append([label, ", ".join(f"{v:.0f}" for v in vals) or "-"]
                         + ([f"{x:.1f}" for x in med] if med else ["-"] * 4))
        s.say(f"\n{model} {cfg}, {n} GPUs: {unit} per run and host ms per step phase (median)")
        s.say(format_table(["variant", unit, "forward", "backward", "step", "GPU tail"],
                           table))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["sweep", "resnet", "phases", "timeline", "ab"])
    p.add_argument("--gpus", type=int, default=2, help="GPUs for the sweep / ResNet-50")
    p.add_argument("--quick", action="store_true", help="sweep: up to 256 MiB, fewer iterations")
    p.add_argument("--configs", default="fp32,bf16",
                   help=f"resnet, phases, timeline, ab: comma list of {', '.join(CONFIGS)}, each "
                   f"optionally with {PG} (ringvod in per-gradient mode)")
    p.add_argument("--model", default="resnet50", choices=list(MODELS),
                   help="resnet, phases, timeline, ab: the model to train")
    p.add_argument("--rounds", type=int, default=2, help="resnet, phases, ab: alternating rounds")
    p.add_argument("--one-gpu", action="store_true",
                   help="resnet, timeline: 1-GPU runs too (scaling)")
    p.add_argument("--iters", type=int, default=90,
                   help="resnet, phases, ab: timed steps (3 windows)")
    p.add_argument("--script-args", default="",
                   help="resnet, phases, timeline, ab: more arguments for both scripts, e.g. "
                   "'--device cpu --batch 2 --seq 16 --layers 1 --warmup 1' (a smoke test)")
    p.add_argument("--cycles", default="1,2.5,10",
                   help="phases: cycle times (ms) for ringvod's per-gradient runs")
    p.add_argument("--base", help="ab: the library to compare with (a git revision, or a folder "
                   "with collective/, frameworks/, horovod/ and launcher/)")
    p.add_argument("--ddp", action="store_true", help="ab: a DDP run per round too")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole part")
    a = p.parse_args()
    # Absolute: the runs work in the repository folder, whatever the caller's folder is.
    out = os.path.abspath(os.environ.get("OUT") or os.path.join(REPO, "out"))
    os.makedirs(out, exist_ok=True)
    s = Suite(out, a.budget)
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if c.removesuffix(PG) not in CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}, each "
                f"optionally with {PG}")
    if a.part == "ab":
        if not a.base:
            p.error("ab needs --base (a git revision or a folder with a copy of the library)")
        try:
            base, a.base = base_library(a.base, out)
        except ValueError as exc:
            p.error(str(exc))
        s.say(f"== {a.model}: this checkout's library vs {a.base} at {a.gpus} GPUs, configs "
              f"{','.join(configs)}")
        rows = ab(s, a.gpus, configs, a.rounds, a.iters, base, a.model,
                  shlex.split(a.script_args), a.ddp)
        write_results(os.path.join(out, "ab.json"), "gpu_ab", rows,
                      params={"model": a.model, "iters": a.iters, "gpus": a.gpus,
                              "rounds": a.rounds, "base": a.base, "ddp": a.ddp,
                              "unit": MODELS[a.model][1], "script_args": a.script_args})
    elif a.part == "sweep":
        sweep(s, a.gpus, a.quick)
    elif a.part == "timeline":
        timeline(s, a.gpus, configs, a.model, a.one_gpu, shlex.split(a.script_args))
    elif a.part == "phases":
        cycles = [float(c) for c in a.cycles.split(",") if c]
        s.say(f"== {a.model}: where the step goes, {a.gpus} GPUs, cycle times {cycles} ms")
        rows = phases(s, a.gpus, configs, cycles, a.rounds, a.iters, a.model,
                      shlex.split(a.script_args))
        write_results(os.path.join(out, f"phases_{a.model}.json"), f"gpu_phases_{a.model}",
                      rows, params={"model": a.model, "iters": a.iters, "gpus": a.gpus,
                                    "rounds": a.rounds, "cycles_ms": cycles,
                                    "unit": MODELS[a.model][1], "script_args": a.script_args})
    else:
        s.say(f"== {a.model}: ringvod vs DDP at {a.gpus} GPUs, configs {','.join(configs)}")
        rows = resnet(s, a.gpus, configs, a.rounds, a.iters, a.one_gpu, a.model,
                      shlex.split(a.script_args))
        name = "resnet.json" if a.model == "resnet50" else f"{a.model}.json"
        write_results(os.path.join(out, name), "gpu_resnet" if a.model == "resnet50"
                      else f"gpu_{a.model}", rows,
                      params={"model": a.model, "batch": {"resnet50": 64}.get(a.model, 32),
                              "seq": None if a.model == "resnet50" else 128,
                              "iters": a.iters, "gpus": a.gpus, "rounds": a.rounds,
                              "unit": MODELS[a.model][1], "script_args": a.script_args})
        resnet_table(s, rows, a.model)
    if a.part == "ab" and any(r["wrong_library"] for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
