"""Synthetic ResNet-50 training throughput with PyTorch DDP: the baseline for gpu_resnet.py.

`baselines/ddp_resnet_orig.py` is the plain DDP reference script; this copy keeps its model
and step exactly and adds what the comparison needs: `--compression
fp16|bf16` (DDP's own fp16/bf16 compress comm hooks, the counterpart of ringvod's gradient
compression) and `--repeats` (the median of several timed windows, so one slow window does not
decide). Launch: `torchrun --standalone --nproc-per-node 2 benchmarks/ddp_resnet.py [--amp]`.
Prints `RESULT impl=DDP world=.. amp=.. compression=.. img_per_sec_total=..`.
"""
import argparse
import os
import statistics
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchvision  # noqa: E402


def phases(step_parts, a, show, label):
    """Host time of forward, backward and step (plus the GPU tail after step) per step."""
    torch.cuda.synchronize()
    parts = [step_parts() for _ in range(20)]
    med = [statistics.median(p[i] for p in parts) * 1e3 for i in range(4)]
    if show:
        print(f"PHASES {label} amp={a.amp}: forward {med[0]:.1f} ms, backward {med[1]:.1f} ms, "
              f"step {med[2]:.1f} ms, gpu tail {med[3]:.1f} ms (host times, median of 20)",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--phases", action="store_true", help="print host time per step phase")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    a = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("nccl")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
        if a.compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            hook = (default_hooks.fp16_compress_hook if a.compression == "fp16"
                    else default_hooks.bf16_compress_hook)
            model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    def step_parts():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for _ in range(a.warmup):
        step()
    per = max(a.iters // a.repeats, 1)
    windows = []
    for _ in range(a.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(per):
            step()
        torch.cuda.synchronize()
        windows.append(a.batch * per / (time.perf_counter() - t))
    ips = torch.tensor(windows, device="cuda")
    if world > 1:
        dist.all_reduce(ips)
    total = statistics.median(ips.tolist())
    if rank == 0:
        print(f"RESULT impl=DDP world={world} amp={a.amp} compression={a.compression} "
              f"batch={a.batch} img_per_sec_total={total:.1f} "
              f"windows={','.join(f'{w:.0f}' for w in ips.tolist())}", flush=True)
    if a.phases:
        phases(step_parts, a, rank == 0, "DDP")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
