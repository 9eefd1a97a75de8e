"""Synthetic training throughput with ringvod (the PyTorch adapter): ResNet-50 or a transformer.

The models, data and step are those of `ddp_resnet.py` (PyTorch DDP), built by `_models.py`,
with `hvd.DistributedOptimizer` instead of DDP, so the two compare like with like. `--model
resnet50` (default; batch 64, images/s) or `--model transformer` (a BERT-base-shaped encoder of
154 parameter tensors; batch 32 x `--seq` 128, samples/s; `--layers` to shrink it). One
process per GPU; at 1 process the optimizer is the plain one (ringvod adds nothing).
`HOROVOD_BUCKET_CAP_MB=0` in the ranks' environment selects Horovod's per-gradient mode (one
allreduce per gradient, fused by the runtime) instead of gradient buckets. Launch::

    mpirun --allow-run-as-root --bind-to none -np 2 -x NCCL_NVLS_ENABLE=0 \
        python benchmarks/gpu_resnet.py [--model transformer] [--amp] [--compression fp16|bf16]

Prints `LIBRARY <folder>` (where ringvod was imported from: a copy named on `PYTHONPATH`,
else this checkout; `_library.py`), `MODEL ...` (parameter tensors and count), then
`RESULT impl=ringvod world=.. amp=.. compression=.. batch=.. img_per_sec_total=.. model=..
unit=..` (the key says img but the
number is in `unit`: img/s or samples/s), then `MEMORY impl=ringvod ...`: the peak of torch's
allocator after warm-up, the device's used memory and what ringvod holds (CuPy pool, the NCCL
engine's fusion buffer, the gradient buckets; see `_models.ringvod_memory`).
`--profile DIR` also records one training step with torch.profiler on rank 0 and writes
`DIR/timeline_step.json` (Chrome trace: kernels per stream, NCCL on ringvod's own stream) and
`DIR/timeline_step.png` (compute vs communication kernels on a time axis).
`--compile` runs the model through `torch.compile`.
`--device cpu` runs the same on CPU tensors (MPI or tcp engines; a smoke test, not a benchmark).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import _library

_library.use_checkout()  # a copy on PYTHONPATH first, else this checkout

import _models
import torch

import frameworks.torch as hvd


def main() -> int:
    p = argparse.ArgumentParser()
    _models.add_args(p)
    p.add_argument("--tag", default="", help="label printed with the result")
    p.add_argument("--groups", type=int, default=0, help="DistributedOptimizer(groups=N)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval(SECONDS) before training (0: Python's default)")
    a = p.parse_args()
    if a.switch_interval > 0:
        sys.setswitchinterval(a.switch_interval)
    a.batch = a.batch or _models.DEFAULT_BATCH[a.model]
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.backends.cudnn.benchmark = True
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # one process per core, as one per GPU
        device = torch.device("cpu")
    sync = _models.synchronizer(device)
    w = _models.build(a.model, device, a.batch, seq=a.seq, layers=a.layers,
                      vocab=a.vocab)
    if rank == 0:
        print(f"LIBRARY {_library.where()}", flush=True)
        print(w.describe(a.model), flush=True)
    model = w.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if world > 1:
        comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                "bf16": hvd.Compression.bf16}[a.compression]
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=comp, groups=a.groups or None)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model = _models.maybe_compile(model, a.compile)
    step, step_parts = _models.make_steps(model, opt, w, device, a.amp, sync)
    windows, used_max = _models.time_windows(step, sync, device, a.batch, a.warmup, a.iters,
                                             a.repeats)
    ips = torch.tensor(windows)
    if world > 1:
        ips = hvd.allreduce(ips, op=hvd.Sum, name="bench.ips")
    total = statistics.median(ips.tolist())
    if rank == 0:
        print(f"RESULT impl=ringvod{a.tag} world={world} amp={a.amp} "
              f"compression={a.compression} batch={a.batch} img_per_sec_total={total:.1f} "
              f"windows={','.join(f'{v:.0f}' for v in ips.tolist())} model={a.model} "
              f"unit={w.unit} bucket_cap_mb={os.environ.get('HOROVOD_BUCKET_CAP_MB', 'default')}",
              flush=True)
        extra = _models.ringvod_memory(opt, device)
        print(_models.memory_line(f"impl=ringvod{a.tag} world={world} model={a.model}", device,
                                  used_max, extra), flush=True)
    if a.phases:
        _models.phases(step_parts, a.amp, sync, rank == 0, "ringvod" + a.tag)
    if a.profile:
        _models.profile_step(step, sync, device, a, rank == 0,
                             f"one {a.model} step, ringvod, {world} GPUs")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
