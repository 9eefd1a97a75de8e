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
`MEMORY impl=DDP ...`. `--device cpu` runs it on CPU with gloo (a smoke test).
"""
import argparse
import os
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models
import torch
import torch.distributed as dist


def phases(step_parts, a, sync, show, label):
    """Host time of forward, backward and step (plus the GPU tail after step) per step."""
    sync()
    parts = [step_parts() for _ in range(20)]
    med = [statistics.median(p[i] for p in parts) * 1e3 for i in range(4)]
    if show:
        print(f"PHASES {label} amp={a.amp}: forward {med[0]:.1f} ms, backward {med[1]:.1f} ms, "
              f"step {med[2]:.1f} ms, gpu tail {med[3]:.1f} ms (host times, median of 20)",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50", choices=_models.MODELS)
    p.add_argument("--batch", type=int, default=0,
                   help="per process (default: 64 for resnet50, 32 for transformer)")
    p.add_argument("--seq", type=int, default=128, help="transformer: tokens per sample")
    p.add_argument("--layers", type=int, default=12, help="transformer: encoder layers")
    p.add_argument("--vocab", type=int, default=_models.VOCAB, help="transformer: vocabulary")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--phases", action="store_true", help="print host time per step phase")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    a = p.parse_args()
    a.batch = a.batch or _models.DEFAULT_BATCH[a.model]
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)

        def sync():
            torch.cuda.synchronize()
    else:
        torch.set_num_threads(1)  # one process per core, as one per GPU
        device = torch.device("cpu")

        def sync():
            pass
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
    x, y = w.x, w.y

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.amp):
            loss = w.loss(model(x), y)
        loss.backward()
        opt.step()

    def step_parts():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.amp):
            loss = w.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for _ in range(a.warmup):
        step()
    _models.reset_peak(device)
    per = max(a.iters // a.repeats, 1)
    windows, used = [], []
    for _ in range(a.repeats):
        sync()
        t = time.perf_counter()
        for _ in range(per):
            step()
        sync()
        windows.append(a.batch * per / (time.perf_counter() - t))
        used.append(_models.device_used(device))
    ips = torch.tensor(windows, device=device)
    if world > 1:
        dist.all_reduce(ips)
    total = statistics.median(ips.tolist())
    if rank == 0:
        print(f"RESULT impl=DDP world={world} amp={a.amp} compression={a.compression} "
              f"batch={a.batch} img_per_sec_total={total:.1f} "
              f"windows={','.join(f'{v:.0f}' for v in ips.tolist())} model={a.model} "
              f"unit={w.unit}", flush=True)
        seen = [u for u in used if u is not None]
        print(_models.memory_line(f"impl=DDP world={world} model={a.model}", device,
                                  max(seen) if seen else None), flush=True)
    if a.phases:
        phases(step_parts, a, sync, rank == 0, "DDP")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
