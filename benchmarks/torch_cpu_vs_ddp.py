"""ringvod vs PyTorch DDP (gloo) on CPU: same model, batch, threads and machine, same run.

    python benchmarks/torch_cpu_vs_ddp.py --np 2 --model small_cnn --rounds 6

Both sides run the same model, data, step and timing loop as
`examples/pytorch/pytorch_synthetic_benchmark.py` (imported from it): ringvod ranks under
`mpirun` (or `hvdrun --gloo`, the tcp engine, with `--mode tcp`) with `DistributedOptimizer`,
broadcast of parameters and optimizer state; DDP ranks started torchrun-style (RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT) with `DistributedDataParallel` over gloo. `--example`
runs the example script itself for the ringvod side.

Rounds alternate the sides (and who goes first) so that load from other processes hits them
alike. Reported per side: "Total img/sec" (median and best round) and, because wall-clock
throughput on a shared box varies with other load, the CPU seconds all ranks spend per 1000
images in the timed part (every thread: compute, communication, coordinator). With one rank
per core, throughput on a dedicated box is bounded by that CPU cost. ringvod comes from a copy
named on `PYTHONPATH`, else this checkout (`_library.py`); the `LIBRARY <folder>` line under
the settings says which.
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _library  # noqa: E402

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "pytorch", "pytorch_synthetic_benchmark.py")
TOTAL = re.compile(r"Total img/sec on (\d+) \w+\(s\): ([0-9.]+) \+-([0-9.]+)")
CPU = re.compile(r"CPU s per 1000 img rank \d+: ([0-9.]+)")


def _bench_args(a: argparse.Namespace) -> list[str]:
    return ["--no-cuda", "--model", a.model, "--batch-size", str(a.batch_size),
            "--image-size", str(a.image_size), "--num-classes", str(a.num_classes),
            "--num-warmup-batches", str(a.num_warmup_batches),
            "--num-batches-per-iter", str(a.num_batches_per_iter),
            "--num-iters", str(a.num_iters)]


def _env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    env["PYTHONPATH"] = _library.pythonpath()
    return env


def _ringvod_cmd(a: argparse.Namespace) -> list[str]:
    if a.example:
        return [sys.executable, EXAMPLE, *_bench_args(a)]
    return [sys.executable, os.path.abspath(__file__), "--ringvod-worker", *_bench_args(a)]


def run_ringvod(a: argparse.Namespace, extra: dict[str, str] | None = None) -> tuple[float, str]:
    env = _env(a)
    env.update(extra or {})
    if a.mode == "tcp":  # ringvod's own launcher and TCP/shared-memory engine
        cmd = [sys.executable, "-m", "launcher", "--gloo", "-np", str(a.np), *_ringvod_cmd(a)]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(a.np), "-x", "OMP_NUM_THREADS", "-x", "MKL_NUM_THREADS",
               "-x", "PYTHONPATH", "-x", "OMPI_MCA_mpi_yield_when_idle=1",
               *[x for k in (extra or {}) for x in ("-x", k)], *_ringvod_cmd(a)]
    out = subprocess.run(cmd, cwd=_library.NO_LIBRARY, env=env, capture_output=True,
                         text=True, timeout=a.timeout)
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
    return float(m.group(2)), "\n".join(outs)


def _worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for flag, typ, default in (("--model", str, "small_cnn"), ("--batch-size", int, 32),
                               ("--image-size", int, 224), ("--num-classes", int, 1000),
                               ("--num-warmup-batches", int, 10),
                               ("--num-batches-per-iter", int, 10), ("--num-iters", int, 10)):
        p.add_argument(flag, type=typ, default=default)
    p.add_argument("--no-cuda", action="store_true")
    return p.parse_args(argv)


def _example_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pytorch_synthetic_benchmark", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(ex)
    return ex


def _timed_loop(step: Any, args: argparse.Namespace, rank: int, size: int) -> None:
    """The example's timing loop; also prints this rank's process CPU seconds per 1000 images
    of the timed part (all threads: compute, communication, coordinator)."""
    import timeit

    import numpy as np

    timeit.timeit(step, number=args.num_warmup_batches)
    img_secs = []
    cpu0 = time.process_time()
    for x in range(args.num_iters):
        t = timeit.timeit(step, number=args.num_batches_per_iter)
        img_secs.append(args.batch_size * args.num_batches_per_iter / t)
        if rank == 0:
            print(f"Iter #{x}: {img_secs[-1]:.1f} img/sec per CPU", flush=True)
    cpu = time.process_time() - cpu0
    images = args.batch_size * args.num_batches_per_iter * args.num_iters
    print(f"CPU s per 1000 img rank {rank}: {1000 * cpu / images:.3f}", flush=True)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    if rank == 0:
        print(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
        print(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}",
              flush=True)


def ddp_worker(argv: list[str]) -> None:
    """One DDP rank: the example's model and timing loop, with DDP doing the averaging."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    args = _worker_args(argv)
    ex = _example_module()
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

    _timed_loop(step, args, rank, size)
    dist.destroy_process_group()


def ringvod_worker(argv: list[str]) -> None:
    """One ringvod rank: exactly the example's setup and step, in the shared timing loop."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    args = _worker_args(argv)
    ex = _example_module()
    hvd.init()
    model = ex.build_model(args.model, args.num_classes)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    _timed_loop(step, args, hvd.rank(), hvd.size())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        ddp_worker(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--ringvod-worker":
        ringvod_worker(sys.argv[2:])
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
    ap.add_argument("--variant", action="append", default=[],
                    help="a ringvod series with extra env, e.g. 'cycle10:HOROVOD_CYCLE_TIME=10' "
                         "(repeatable; without it one default ringvod series runs)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--example", action="store_true",
                    help="ringvod side runs examples/pytorch/pytorch_synthetic_benchmark.py "
                         "itself (no CPU accounting) instead of the shared worker loop")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    print(f"ringvod mode={a.mode} model={a.model} batch={a.batch_size} image={a.image_size} np={a.np} "
          f"threads/rank={a.threads} cpus={os.cpu_count()} iters={a.num_iters}x"
          f"{a.num_batches_per_iter} rounds={a.rounds}", flush=True)
    print(f"LIBRARY {_library.where()}", flush=True)
    series: dict[str, list[float]] = {}
    sides = [("ddp", lambda: run_ddp(a))]
    if not a.variant:
        sides.insert(0, ("ringvod", lambda: run_ringvod(a)))
    for spec in a.variant:
        label, _, assigns = spec.partition(":")
        extra = dict(kv.split("=", 1) for kv in assigns.split(",") if kv)
        sides.insert(-1, (f"ringvod/{label}", lambda extra=extra: run_ringvod(a, extra)))
    cpu: dict[str, list[float]] = {}
    for i in range(a.rounds):
        for label, fn in (sides if i % 2 == 0 else sides[::-1]):  # alternate who goes first
            v, out = fn()
            series.setdefault(label, []).append(v)
            per_rank = [float(x) for x in CPU.findall(out)]
            note = ""
            if per_rank:
                cpu.setdefault(label, []).append(sum(per_rank))
                note = f"   CPU s/1000 img (all ranks) {sum(per_rank):6.2f}"
            print(f"round {i} {label:16s} total img/sec {v:8.1f}{note}", flush=True)
            if a.verbose:
                print(out)
    d_med, d_best = statistics.median(series["ddp"]), max(series["ddp"])
    for label, vals in series.items():
        med = statistics.median(vals)
        print(f"{label:16s} img/sec median {med:7.1f} best {max(vals):7.1f}  ratio to ddp: "
              f"median {med / d_med:.3f} best {max(vals) / d_best:.3f}")
    if "ddp" in cpu:
        d_cpu = statistics.median(cpu["ddp"])
        for label, vals in cpu.items():
            med = statistics.median(vals)
            print(f"{label:16s} CPU s per 1000 img median {med:6.2f}  ratio ddp/this "
                  f"{d_cpu / med:.3f} (>1: cheaper than DDP)")


if __name__ == "__main__":
    main()
