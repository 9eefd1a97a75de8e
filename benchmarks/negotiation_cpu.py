"""Negotiation's slow path (cache misses): the cost of a round's control-plane messages.

Two parts, each alternating the trees given with `--tree` (e.g. this checkout and an older one
unpacked with `git archive`), so that every number has its baseline from the same run:

* codec: encode + decode of a request list and a response list of `--tensors` entries, every
  tree's codec loaded into one process and run interleaved (median of many repetitions);
* rounds: a 2-rank tcp job (torchrun-style variables, loopback) with the response cache off
  (HOROVOD_CACHE_CAPACITY=0), so every step negotiates on the slow path: `--tensors` tiny
  tensors submitted with allreduce_async and synchronized; median time per step.

Run: `python benchmarks/negotiation_cpu.py --tree . --tree /tmp/base`. Prints a table.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys

_CODEC = r"""
import importlib.util, statistics, sys, time
from collective.types import *
trees, n, reps = sys.argv[3:], int(sys.argv[1]), int(sys.argv[2])
mods = []
for i, t in enumerate(trees):  # each tree's codec, in this one process (types are shared)
    spec = importlib.util.spec_from_file_location(f"collective._neg{i}",
                                                  f"{t}/collective/negotiation.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    mods.append(m)
reqs = [Request(rank=1, type=RequestType.ALLREDUCE, name=f"grad.layer{i}.weight",
                dtype=DataType.FLOAT32, shape=(128, 64)) for i in range(n)]
resps = [Response(type=ResponseType.ALLREDUCE, names=[r.name for r in reqs], sizes=[8192] * n,
                  shapes=[r.shape for r in reqs])]
res = [([], []) for _ in mods]
for _ in range(reps):  # interleaved: load changes hit every tree alike
    for m, (rq, rs) in zip(mods, res):
        t = time.perf_counter()
        for _ in range(20):
            m.decode_requests(m.encode_requests(reqs, False))
        rq.append((time.perf_counter() - t) / 20 * 1e6)
        t = time.perf_counter()
        for _ in range(20):
            m.decode_responses(m.encode_responses(resps, False, False))
        rs.append((time.perf_counter() - t) / 20 * 1e6)
for rq, rs in res:
    print(statistics.median(rq), statistics.median(rs))
"""

_ROUNDS = r"""
import statistics, sys, time, numpy as np
import collective as hvd
n, steps = int(sys.argv[1]), int(sys.argv[2])
hvd.init()
xs = [np.ones(1, np.float32) for _ in range(n)]
ts = []
for s in range(steps):
    t = time.perf_counter()
    hs = [hvd.allreduce_async(x, name=f"t{i}") for i, x in enumerate(xs)]
    for h in hs:
        hvd.synchronize(h)
    ts.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(statistics.median(ts[steps // 5:]) * 1e3, flush=True)
hvd.shutdown()
"""


# Each child runs `python -c` in its tree's folder: `-c` puts the working folder first on
# sys.path, ahead of PYTHONPATH, so it imports that tree's library wherever this script runs.
def _env(tree: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.path.abspath(tree)
    return env


def codec(trees: list[str], n: int, reps: int = 40) -> list[tuple[float, float]]:
    out = subprocess.run([sys.executable, "-c", _CODEC, str(n), str(reps)] +
                         [os.path.abspath(t) for t in trees], env=_env(trees[0]),
                         cwd=trees[0], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    return [(float(line.split()[0]), float(line.split()[1])) for line in out]


def rounds(tree: str, n: int, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(_env(tree), RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port - 1), HOROVOD_CACHE_CAPACITY="0",
                   HOROVOD_SECRET_KEY="ab" * 16, HOROVOD_LOG_LEVEL="error")
        procs.append(subprocess.Popen([sys.executable, "-c", _ROUNDS, str(n), str(steps)],
                                      env=env, cwd=tree, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return float(outs[0].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="PYTHONPATH of a version")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res: dict[str, dict[str, list[float]]] = {t: {"req": [], "resp": [], "step": []}
                                              for t in a.tree}
    for rep in range(a.repeats):
        for t, (q, p) in zip(a.tree, codec(a.tree, a.tensors)):
            res[t]["req"].append(q)
            res[t]["resp"].append(p)
        for t in a.tree:
            res[t]["step"].append(rounds(t, a.tensors, a.steps))
            print(f"round {rep + 1}/{a.repeats} {t}: requests {res[t]['req'][-1]:.0f} us, "
                  f"responses {res[t]['resp'][-1]:.0f} us, step {res[t]['step'][-1]:.2f} ms",
                  file=sys.stderr, flush=True)
    base = a.tree[-1]
    print(f"{a.tensors} tensors per step, medians of {a.repeats} runs; ratio vs {base}")
    print(f"{'tree':40} {'req codec us':>13} {'resp codec us':>14} {'slow-path step ms':>18}")
    for t in a.tree:
        m = {k: statistics.median(v) for k, v in res[t].items()}
        b = {k: statistics.median(v) for k, v in res[base].items()}
        print(f"{t:40} {m['req']:8.0f} x{m['req'] / b['req']:.2f} "
              f"{m['resp']:8.0f} x{m['resp'] / b['resp']:.2f} "
              f"{m['step']:11.2f} x{m['step'] / b['step']:.2f}")


if __name__ == "__main__":
    main()
