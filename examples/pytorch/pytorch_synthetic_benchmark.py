"""Synthetic training throughput, as Horovod's `examples/pytorch/pytorch_synthetic_benchmark.py`.

    # CPU: sizes that finish in well under a minute on 2 cores
    hvdrun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py --no-cuda \
        --model small_cnn --image-size 32 --batch-size 16 --num-warmup-batches 3 \
        --num-batches-per-iter 5 --num-iters 5
    hvdrun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py   # resnet50, GPUs

Same flags and output lines as Horovod's script. `--model` takes a torchvision model name when
torchvision is installed; otherwise (and for the names below) built-in models are used:
`small_cnn`, `resnet_tiny`, `resnet18`, `resnet50`. `--image-size` and `--num-classes` are
ringvod additions (defaults 224 and 1000, Horovod's fixed values).
"""
from __future__ import annotations

import argparse
import time
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd


# -- built-in models (used when torchvision is missing, or asked for by name) ---------------------
class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(4))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 16, 256),
                                        nn.ReLU(inplace=True), nn.Linear(256, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.down = None
        if stride != 1 or cin != width:
            self.down = nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False),
                                      nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """torchvision-shaped ResNet (stem, four stages, global pool, fc)."""

    def __init__(self, block: type, layers: list[int], widths: list[int],
                 num_classes: int = 1000, stem: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], stem
        for i, (n, w) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


BUILTIN = {
    "small_cnn": lambda n: SmallCNN(n),
    "resnet_tiny": lambda n: ResNet(BasicBlock, [1, 1, 1, 1], [16, 32, 64, 128], n, stem=16),
    "resnet18": lambda n: ResNet(BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512], n),
    "resnet50": lambda n: ResNet(Bottleneck, [3, 4, 6, 3], [64, 128, 256, 512], n),
}


def build_model(name: str, num_classes: int = 1000) -> nn.Module:
    """A torchvision model by name if torchvision has it, else a built-in one.

    Raises:
        SystemExit: unknown name.
    """
    if name not in ("small_cnn", "resnet_tiny"):
        try:
            from torchvision import models
            if hasattr(models, name):
                return getattr(models, name)(num_classes=num_classes)
        except ImportError:
            pass
    if name not in BUILTIN:
        raise SystemExit(f"unknown --model {name!r}: torchvision is not installed or has no such "
                         f"model; built-in models: {', '.join(BUILTIN)}")
    return BUILTIN[name](num_classes)


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use adasum algorithm to do reduction")
    parser.add_argument("--image-size", type=int, default=224, help="input height and width")
    parser.add_argument("--num-classes", type=int, default=1000, help="number of classes")
    args = parser.parse_args()
    if args.use_adasum:
        parser.error("--use-adasum: ringvod does not implement Adasum; drop the flag to use "
                     "Average")
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cudnn.benchmark = True
    else:  # the ranks of a host share its cores
        torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))

    model = build_model(args.model, args.num_classes)
    if args.cuda:
        model.cuda()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")

    log("Running warmup...")
    start = time.perf_counter()
    for i in range(args.num_warmup_batches):  # the first steps are the slowest: show progress
        benchmark_step()
        log(f"Warmup batch {i + 1}/{args.num_warmup_batches}: "
            f"{time.perf_counter() - start:.1f} s")

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")


if __name__ == "__main__":
    main()
