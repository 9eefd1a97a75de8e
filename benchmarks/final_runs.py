"""The GPU runs behind the issue-5 and issue-7 results, in one or two device calls.

    OUT=out python3 benchmarks/final_runs.py issue5 --budget 500   # 2 GPUs (and 1)
    OUT=out python3 benchmarks/final_runs.py scale --gpus 4          # N GPUs: sweep + ResNet
    OUT=out python3 benchmarks/final_runs.py recheck --gpus 4        # after a fix: both, shorter
    OUT=out python3 benchmarks/final_runs.py pairs --configs bf16 --rounds 3  # ratio + spread

`issue5`: tests/gpu (MPI and tcp modes), the lone-op latency breakdown, the allreduce sweep
(ringvod vs CuPy NCCL vs torch.distributed), ResNet-50 at 1 GPU (ringvod and DDP, fp32 and bf16
autocast) and at 2 GPUs in every configuration (fp32, bf16 autocast, fp16 and bf16 gradient
compression) with ringvod and DDP alternating, twice for fp32 and bf16, and one profiled step.
`scale`: the sweep and ResNet-50 fp32/bf16 (ringvod vs DDP) at N GPUs.

Run it through `benchmarks/run_gpu_suite.sh exec` (NCCL multicast switches, MPI). Results go to
$OUT (final_*.json, suite.log); the tables are printed last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _report import format_table, write_results  # noqa: E402
from gpu_suite import PY, Suite, parse  # noqa: E402

CONFIGS = {  # label -> (amp, compression)
    "fp32": (False, "none"), "bf16": (True, "none"),
    "fp32+fp16 comp": (False, "fp16"), "bf16+bf16 comp": (True, "bf16"),
}


def resnet(s: Suite, n: int, impl: str, cfg: str, iters: int, extra=()) -> float | None:
    amp, comp = CONFIGS[cfg]
    flags = ["--iters", str(iters), "--warmup", "15", "--repeats", "3",
             "--compression", comp] + (["--amp"] if amp else []) + list(extra)
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
    v = rows[-1]["throughput"]
    s.say(f"-- {n} GPU(s) {cfg} {impl}: {v:.0f} img/s")
    return v


def sweep(s: Suite, n: int, png: bool) -> None:
    args = [os.path.join(HERE, "gpu_allreduce.py"), "--json",
            os.path.join(s.out, f"allreduce_{n}gpu.json"), "--lone-sizes", "1024,4096"]
    if png:
        args += ["--png", os.path.join(s.out, f"allreduce_{n}gpu.png")]
    out = s.run(s.mpi(n, args), 200)
    s.say("\n".join(line for line in out.splitlines() if not line.startswith("[")))


def tests_and_latency(s: Suite, select: str | None) -> bool:
    """tests/gpu (optionally `-k select`), the lone-op breakdown and the 2-GPU sweep; False
    (and nothing else runs) when the tests do not pass."""
    s.say(f"== tests/gpu (2 ranks; {select or 'MPI and tcp modes'})")
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/gpu"]
    out = s.run(cmd + (["-k", select] if select else []), 240,
                env={"RINGVOD_TEST_REQUIRE": "gpu,mpi"})
    tail = out.splitlines()[-1] if out.strip() else ""
    s.say("\n".join(out.splitlines()[-4:]))
    if "passed" not in tail or "failed" in tail or "error" in tail:
        s.say("!! tests/gpu did not pass: no benchmarks")
        return False
    s.say("== lone synchronous allreduce, per stage")
    out = s.run(s.mpi(2, [os.path.join(HERE, "latency_probe.py"), "--device", "cuda",
                          "--sync-api"]), 90)
    s.say("\n".join(line for line in out.splitlines() if not line.startswith("[")))
    s.say("== allreduce sweep, 2 GPUs")
    sweep(s, 2, png=True)
    return True


def issue5(s: Suite, iters: int) -> list[dict]:
    if not tests_and_latency(s, None):
        return []
    rows = []
    for cfg in ("fp32", "bf16"):
        for impl in ("ringvod", "DDP"):
            v = resnet(s, 1, impl, cfg, iters)
            rows.append({"gpus": 1, "config": cfg, "impl": impl, "round": 1, "img_s": v})
    for rnd in (1, 2):
        for cfg in CONFIGS:
            if rnd == 2 and "comp" in cfg:
                continue
            order = ("DDP", "ringvod") if rnd == 1 else ("ringvod", "DDP")
            for impl in order:
                v = resnet(s, 2, impl, cfg, iters)
                rows.append({"gpus": 2, "config": cfg, "impl": impl, "round": rnd, "img_s": v})
    s.say("== one profiled ringvod step (fp32, 2 GPUs)")
    out = s.run(s.mpi(2, [os.path.join(HERE, "gpu_resnet.py"), "--iters", "10", "--warmup", "10",
                          "--profile", s.out]), 150)
    s.say("\n".join(line for line in out.splitlines() if line.startswith(("TRACE", "PROFILE"))))
    return rows


def scale(s: Suite, n: int, iters: int) -> list[dict]:
    s.say(f"== allreduce sweep, {n} GPUs")
    sweep(s, n, png=True)
    rows = []
    for cfg in ("fp32", "bf16"):
        for impl in ("DDP", "ringvod"):
            v = resnet(s, n, impl, cfg, iters)
            rows.append({"gpus": n, "config": cfg, "impl": impl, "round": 1, "img_s": v})
    return rows


def recheck(s: Suite, n: int, iters: int) -> list[dict]:
    """After a fix: tests (MPI mode), latency, the 2-GPU sweep, bf16 at 2 GPUs twice (DDP and
    ringvod alternating), then the scaling runs at 1 and `n` GPUs."""
    if not tests_and_latency(s, "spmd and mpi"):
        return []
    rows = []
    for rnd, order in ((1, ("DDP", "ringvod")), (2, ("ringvod", "DDP"))):
        for impl in order:
            v = resnet(s, 2, impl, "bf16", iters)
            rows.append({"gpus": 2, "config": "bf16", "impl": impl, "round": rnd, "img_s": v})
    for cfg in ("fp32", "bf16"):
        for impl in ("ringvod", "DDP"):
            v = resnet(s, 1, impl, cfg, iters)
            rows.append({"gpus": 1, "config": cfg, "impl": impl, "round": 1, "img_s": v})
    return rows + scale(s, n, iters)


def ab(s: Suite, iters: int) -> list[dict]:
    """Drive on/off for the lone synchronous op (alternating), the 2-GPU sweep, a bf16 pair."""
    s.say("== tests/gpu (MPI mode)")
    out = s.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/gpu",
                 "-k", "spmd and mpi"], 150, env={"RINGVOD_TEST_REQUIRE": "gpu,mpi"})
    s.say(out.splitlines()[-1] if out.strip() else "(no output)")
    for flags in ([], ["--no-drive"], [], ["--no-drive"]):
        out = s.run(s.mpi(2, [os.path.join(HERE, "latency_probe.py"), "--device", "cuda",
                              "--sync-api"] + flags), 60)
        s.say("\n".join(line for line in out.splitlines()
                        if line.startswith(("lone", "  cycle", "  words", "  set", "  synced"))))
    s.say("== allreduce sweep, 2 GPUs")
    sweep(s, 2, png=True)
    rows = []
    for impl in ("ringvod", "DDP"):
        v = resnet(s, 2, impl, "bf16", iters)
        rows.append({"gpus": 2, "config": "bf16", "impl": impl, "round": 3, "img_s": v})
    return rows


def pairs(s: Suite, iters: int, configs: list[str], rounds: int,
          one_gpu: bool = False) -> list[dict]:
    """ResNet-50 at 2 GPUs, ringvod and DDP alternating (the first of each round alternates),
    `rounds` times per configuration: a ratio with its spread from one machine. `one_gpu`:
    first each configuration at 1 GPU too (both), for the scaling efficiency."""
    rows = []
    if one_gpu:
        for cfg in configs:
            for impl in ("ringvod", "DDP"):
                v = resnet(s, 1, impl, cfg, iters)
                rows.append({"gpus": 1, "config": cfg, "impl": impl, "round": 1, "img_s": v})
    for rnd in range(1, rounds + 1):
        for cfg in configs:
            order = ("DDP", "ringvod") if rnd % 2 else ("ringvod", "DDP")
            for impl in order:
                v = resnet(s, 2, impl, cfg, iters)
                rows.append({"gpus": 2, "config": cfg, "impl": impl, "round": rnd, "img_s": v})
    return rows


def table(s: Suite, rows: list[dict]) -> None:
    def med(n, cfg, impl):
        vals = [r["img_s"] for r in rows if r["gpus"] == n and r["config"] == cfg
                and r["impl"] == impl and r["img_s"]]
        return statistics.median(vals) if vals else None, vals
    out = []
    for cfg in CONFIGS:
        for n in sorted({r["gpus"] for r in rows}):
            (rv, rvs), (dd, dds) = med(n, cfg, "ringvod"), med(n, cfg, "DDP")
            if rv is None and dd is None:
                continue
            one_rv, one_dd = med(1, cfg, "ringvod")[0], med(1, cfg, "DDP")[0]
            eff = (lambda v, one: f"{v / (n * one) * 100:.0f}%" if v and one and n > 1 else "")
            out.append([cfg, n, "/".join(f"{v:.0f}" for v in rvs),
                        "/".join(f"{v:.0f}" for v in dds), f"{rv / dd:.3f}" if rv and dd else "",
                        eff(rv, one_rv), eff(dd, one_dd)])
    s.say("ResNet-50 synthetic, batch 64/GPU, img/s (every run; ratio of medians):")
    s.say(format_table(["config", "GPUs", "ringvod", "DDP", "ringvod/DDP", "eff rv", "eff DDP"],
                       out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["issue5", "scale", "recheck", "ab", "pairs"])
    p.add_argument("--configs", default="bf16,fp32", help="pairs: configurations")
    p.add_argument("--rounds", type=int, default=2, help="pairs: rounds")
    p.add_argument("--one-gpu", action="store_true", help="pairs: also 1-GPU runs (scaling)")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--budget", type=float, default=560.0)
    p.add_argument("--iters", type=int, default=90, help="timed steps (3 windows)")
    a = p.parse_args()
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "out")
    os.makedirs(out, exist_ok=True)
    s = Suite(out, a.budget)
    if a.part == "issue5":
        rows = issue5(s, a.iters)
    elif a.part == "scale":
        rows = scale(s, a.gpus, a.iters)
    elif a.part == "ab":
        rows = ab(s, a.iters)
    elif a.part == "pairs":
        rows = pairs(s, a.iters, a.configs.split(","), a.rounds, a.one_gpu)
    else:
        rows = recheck(s, a.gpus, a.iters)
    write_results(os.path.join(out, f"final_{a.part}.json"), f"final_{a.part}", rows,
                  params={"batch": 64, "iters": a.iters})
    table(s, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
