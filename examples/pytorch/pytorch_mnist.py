"""MNIST training with `horovod.torch`: real MNIST if it is on disk, else synthetic data.

    hvdrun -np 2 python examples/pytorch/pytorch_mnist.py --epochs 2
    hvdrun -np 2 python examples/pytorch/pytorch_mnist.py --data-dir ~/data   # real MNIST

Real MNIST is read from torchvision's folder layout, `<data-dir>/MNIST/raw/
train-images-idx3-ubyte[.gz]` and the three other files (what `torchvision.datasets.MNIST(
data_dir, download=True)` leaves; torchvision itself is not needed). Nothing is downloaded:
without those files the example trains on synthetic MNIST-shaped data and says so.

Follows Horovod's `examples/pytorch/pytorch_mnist.py`: the same network, DistributedSampler
sharding, learning rate scaled by the world size, parameter/optimizer-state broadcast from rank 0,
DistributedOptimizer (optional fp16 compression / mixed precision), and test metrics averaged
with `hvd.allreduce`. The synthetic 28x28 images are noisy copies of ten fixed binary class
prototypes: the task is easy, so the accuracy reaches ~100% quickly when training works.
"""
from __future__ import annotations

import argparse
import gzip
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import TensorDataset

import horovod.torch as hvd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(n: int, seed: int) -> TensorDataset:
    """Same data on every rank (seeded): shared class prototypes plus noise, labels 0..9."""
    prototypes = (torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
                  > 0.5).float() * 3.0
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = prototypes[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    return TensorDataset(images, labels)


_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def mnist_raw_dir(data_dir: str) -> str | None:
    """torchvision's `<data_dir>/MNIST/raw` if it holds all four MNIST files, else None."""
    raw = os.path.join(os.path.expanduser(data_dir), "MNIST", "raw")
    names = [n for pair in _IDX.values() for n in pair]
    ok = all(os.path.exists(os.path.join(raw, n)) or os.path.exists(os.path.join(raw, n + ".gz"))
             for n in names)
    return raw if ok else None


def _read_idx(path: str) -> torch.Tensor:
    if not os.path.exists(path):
        path += ".gz"
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)


def real_mnist(raw: str, split: str) -> TensorDataset:
    """MNIST's `split` ("train"/"test") from IDX files, normalised as Horovod's example does."""
    images, labels = (_read_idx(os.path.join(raw, n)) for n in _IDX[split])
    x = (images.float().div(255.0).unsqueeze(1) - 0.1307) / 0.3081
    return TensorDataset(x, labels.long())


def metric_average(val: torch.Tensor, name: str) -> float:
    return hvd.allreduce(val.detach().clone(), name=name).item()


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (synthetic data)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N")
    parser.add_argument("--epochs", type=int, default=2, metavar="N")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M")
    parser.add_argument("--no-cuda", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=42, metavar="S")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--use-mixed-precision", action="store_true", default=False)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--data-dir", default="./data",
                        help="where torchvision's MNIST folder is (<dir>/MNIST/raw); without it "
                             "the data is synthetic")
    parser.add_argument("--num-samples", type=int, default=4096,
                        help="synthetic training samples (ringvod addition)")
    args = parser.parse_args()
    if args.use_adasum:
        parser.error("--use-adasum: ringvod does not implement Adasum; drop the flag")
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))

    raw = mnist_raw_dir(args.data_dir)
    if raw is not None:
        train_dataset, test_dataset = real_mnist(raw, "train"), real_mnist(raw, "test")
        data_name = "MNIST"
        about = f"MNIST from {raw}"
    else:
        train_dataset = synthetic_mnist(args.num_samples, seed=1)
        test_dataset = synthetic_mnist(max(args.num_samples // 4, 10), seed=2)
        data_name = "synthetic MNIST-shaped data"
        about = (f"synthetic MNIST-shaped data (no MNIST in {args.data_dir}/MNIST/raw; an easy "
                 "task, so expect ~100% accuracy)")
    if hvd.rank() == 0:
        print(f"Data: {about}, {len(train_dataset)} training and {len(test_dataset)} test "
              f"samples, {hvd.size()} processes", flush=True)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size()
    if args.cuda:
        model.cuda()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    device = "cuda" if args.cuda else "cpu"
    scaler = torch.amp.GradScaler(device) if args.use_mixed_precision else None

    def train(epoch: int) -> None:
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            if scaler is not None:
                with torch.autocast(device, dtype=torch.float16 if args.cuda
                                    else torch.bfloat16):
                    loss = F.nll_loss(model(data), target)
                scaler.scale(loss).backward()
                optimizer.synchronize()  # unscale the averaged gradients
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            else:
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                      flush=True)

    def test() -> float:
        model.eval()
        test_loss = torch.zeros(())
        test_accuracy = torch.zeros(())
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").cpu()
                pred = output.argmax(dim=1)
                test_accuracy += pred.eq(target).float().sum().cpu()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        avg_loss = metric_average(test_loss, "avg_loss")
        avg_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set ({data_name}): Average loss: {avg_loss:.4f}, "
                  f"Accuracy: {100.0 * avg_accuracy:.2f}%\n", flush=True)
        return avg_accuracy

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()


if __name__ == "__main__":
    main()
