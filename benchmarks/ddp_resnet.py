"""Synthetic training throughput with PyTorch DDP: the baseline for gpu_resnet.py.

`baselines/ddp_resnet_orig.py` is the plain DDP reference script (ResNet-50); this copy keeps
its model and step exactly and adds what the comparison needs: `--model transformer` (the
BERT-base-shaped encoder of `_models.py`, batch 32 x `--seq` 128, samples/s), `--compression
fp16|bf16` (DDP's own fp16/bf16 compress comm hooks, the counterpart of ringvod's gradient
compression), `--repeats` (the median of several timed windows, so one slow window does not
decide) and a `MEMORY` line (torch allocator peak after warm-up, device used memory).
Launch: `torchrun --standalone --nproc-per-node 2 benchmarks/ddp_resnet.py [--model
transformer] [--amp]`. Prints `MODEL ...`, `RESULT impl=DDP world=.. amp=.. compression=..
img_per_sec_total=.. model=.. unit=..` (the number is in `unit`: img/s or samples/s) and
`MEMORY impl=DDP ...`. `--profile DIR` records one step with torch.profiler (as
`gpu_resnet.py`); `--compile` compiles the DDP-wrapped model. `--device cpu` runs it on CPU
with gloo (a smoke test).
"""
import argparse
import os
import statistics
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models
import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    _models.add_args(p)
    a = p.parse_args()
    a.batch = a.batch or _models.DEFAULT_BATCH[a.model]
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)  # one process per core, as one per GPU
        device = torch.device("cpu")
    sync = _models.synchronizer(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    torch.backends.cudnn.benchmark = True
    w = _models.build(a.model, device, a.batch, seq=a.seq, layers=a.layers,
                      vocab=a.vocab)
    if rank == 0:
        print(w.describe(a.model), flush=True)
    model = w.model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local] if cuda else None)
        if a.compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            hook = (default_hooks.fp16_compress_hook if a.compression == "fp16"
                    else default_hooks.bf16_compress_hook)
            model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = _models.maybe_compile(model, a.compile)
    step, step_parts = _models.make_steps(model, opt, w, device, a.amp, sync)
    windows, used_max = _models.time_windows(step, sync, device, a.batch, a.warmup, a.iters,
                                             a.repeats)
    ips = torch.tensor(windows, device=device)
    if world > 1:
        dist.all_reduce(ips)
    total = statistics.median(ips.tolist())
    if rank == 0:
        print(f"RESULT impl=DDP world={world} amp={a.amp} compression={a.compression} "
              f"batch={a.batch} img_per_sec_total={total:.1f} "
              f"windows={','.join(f'{v:.0f}' for v in ips.tolist())} model={a.model} "
              f"unit={w.unit}", flush=True)
        print(_models.memory_line(f"impl=DDP world={world} model={a.model}", device,
                                  used_max), flush=True)
    if a.phases:
        _models.phases(step_parts, a.amp, sync, rank == 0, "DDP")
    if a.profile:
        _models.profile_step(step, sync, device, a, rank == 0,
                             f"one {a.model} step, DDP, {world} GPUs")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
