"""ringvod vs PyTorch DDP (gloo) on CPU: same model, batch, threads and machine, same run.

    python benchmarks/torch_cpu_vs_ddp.py --np 2 --model small_cnn --rounds 3

ringvod runs `examples/pytorch/pytorch_synthetic_benchmark.py` under `mpirun` (or under
`hvdrun --gloo`, the tcp engine, with `--mode tcp`); DDP runs the same model, data and timing loop (imported from that example) in `np` processes started
torchrun-style (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) with the gloo backend. Rounds
alternate ringvod and DDP so that load from other processes hits both alike; the summary gives
each side's median "Total img/sec" and the ratio ringvod / DDP.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "pytorch", "pytorch_synthetic_benchmark.py")
TOTAL = re.compile(r"Total img/sec on (\d+) \w+\(s\): ([0-9.]+) \+-([0-9.]+)")


def _bench_args(a: argparse.Namespace) -> list[str]:
    return ["--no-cuda", "--model", a.model, "--batch-size", str(a.batch_size),
            "--image-size", str(a.image_size), "--num-classes", str(a.num_classes),
            "--num-warmup-batches", str(a.num_warmup_batches),
            "--num-batches-per-iter", str(a.num_batches_per_iter),
            "--num-iters", str(a.num_iters)]


def _env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def run_ringvod(a: argparse.Namespace) -> tuple[float, str]:
    if a.mode == "tcp":  # ringvod's own launcher and TCP/shared-memory engine
        cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(a.np),
               sys.executable, EXAMPLE, *_bench_args(a)]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(a.np), "-x", "OMP_NUM_THREADS", "-x", "MKL_NUM_THREADS",
               "-x", "PYTHONPATH", "-x", "OMPI_MCA_mpi_yield_when_idle=1",
               sys.executable, EXAMPLE, *_bench_args(a)]
    out = subprocess.run(cmd, cwd=REPO, env=_env(a), capture_output=True, text=True,
                         timeout=a.timeout)
    m = TOTAL.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"ringvod run failed (rc {out.returncode}):\n{out.stdout}\n"
                           f"{out.stderr}")
    return float(m.group(2)), out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(a: argparse.Namespace) -> tuple[float, str]:
    port = _free_port()
    procs = []
    for r in range(a.np):
        env = _env(a)
        env.update(RANK=str(r), WORLD_SIZE=str(a.np), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(a.np), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ddp-worker",
                                       *_bench_args(a)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    deadline = time.monotonic() + a.timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    m = TOTAL.search(outs[0])
    if any(p.returncode for p in procs) or m is None:
        raise RuntimeError("DDP run failed:\n" + "\n".join(outs))
    return float(m.group(2)), outs[0]


def ddp_worker(argv: list[str]) -> None:
    """One DDP rank: the example's model and timing loop, with DDP doing the averaging."""
    import importlib.util
    import timeit

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    p = argparse.ArgumentParser()
    for flag, typ, default in (("--model", str, "small_cnn"), ("--batch-size", int, 32),
                               ("--image-size", int, 224), ("--num-classes", int, 1000),
                               ("--num-warmup-batches", int, 10),
                               ("--num-batches-per-iter", int, 10), ("--num-iters", int, 10)):
        p.add_argument(flag, type=typ, default=default)
    p.add_argument("--no-cuda", action="store_true")
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location("pytorch_synthetic_benchmark", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(ex)

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(ex.build_model(args.model,
                                                                     args.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(step, number=args.num_batches_per_iter)
        img_secs.append(args.batch_size * args.num_batches_per_iter / t)
        if rank == 0:
            print(f"Iter #{x}: {img_secs[-1]:.1f} img/sec per CPU", flush=True)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    if rank == 0:
        print(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
        print(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}",
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        ddp_worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--mode", choices=["mpi", "tcp"], default="mpi",
                    help="ringvod under mpirun (MPI engine) or hvdrun --gloo (tcp engine)")
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--num-classes", type=int, default=100)
    ap.add_argument("--num-warmup-batches", type=int, default=5)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch threads per rank (both sides)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    print(f"ringvod mode={a.mode} model={a.model} batch={a.batch_size} image={a.image_size} np={a.np} "
          f"threads/rank={a.threads} cpus={os.cpu_count()} iters={a.num_iters}x"
          f"{a.num_batches_per_iter} rounds={a.rounds}", flush=True)
    ours, theirs = [], []
    sides = [("ringvod", run_ringvod, ours), ("ddp", run_ddp, theirs)]
    for i in range(a.rounds):
        for label, fn, acc in (sides if i % 2 == 0 else sides[::-1]):  # alternate who goes first
            v, out = fn(a)
            acc.append(v)
            print(f"round {i} {label:8s} total img/sec {v:8.1f}", flush=True)
            if a.verbose:
                print(out)
    r, d = statistics.median(ours), statistics.median(theirs)
    print(f"median total img/sec: ringvod {r:.1f}  ddp {d:.1f}  ratio ringvod/ddp {r / d:.3f}")
    print(f"best   total img/sec: ringvod {max(ours):.1f}  ddp {max(theirs):.1f}  "
          f"ratio ringvod/ddp {max(ours) / max(theirs):.3f}")


if __name__ == "__main__":
    main()
