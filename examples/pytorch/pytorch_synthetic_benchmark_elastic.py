"""Elastic synthetic training throughput, as Horovod's
`examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py`.

    # CPU: sizes that finish in well under a minute on 2 cores
    hvdrun -np 2 --min-np 1 -H localhost:1,127.0.0.1:1 --blacklist-cooldown-range 5 30 \
        python examples/pytorch/pytorch_synthetic_benchmark_elastic.py --no-cuda \
        --model small_cnn --image-size 32 --batch-size 16 --num-warmup-batches 3 \
        --num-batches-per-iter 5 --num-iters 20
    # GPUs, hosts from a discovery script (resnet50, Horovod's sizes)
    hvdrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh \
        python examples/pytorch/pytorch_synthetic_benchmark_elastic.py

where `discover_hosts.sh` prints one `hostname:slots` line per available host (Horovod's
defaults, 224x224 images, take minutes per iteration on a CPU). Kill a worker
(or edit what the script prints) while it runs: the others roll back to the last commit (or,
when a host was only added or removed, keep their state), re-form and go on; the learning rate
follows the world size through the reset callback. Models: see pytorch_synthetic_benchmark.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import timeit

import torch
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_synthetic_benchmark import build_model  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (elastic)",
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
parser.add_argument("--batches-per-commit", type=int, default=1,
                    help="number of batches per commit of the elastic state")
parser.add_argument("--batches-per-host-check", type=int, default=1,
                    help="number of batches per check for added or removed hosts")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--image-size", type=int, default=224, help="input height and width")
parser.add_argument("--num-classes", type=int, default=1000, help="number of classes")
args = parser.parse_args()
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
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % args.num_classes
if args.cuda:
    data, target = data.cuda(), target.cuda()


def log(s: str) -> None:
    if hvd.rank() == 0:
        print(s, flush=True)


def benchmark_step(state: hvd.elastic.TorchState) -> None:
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    state.batch += 1
    if state.batch == args.batches_per_commit:
        state.batch = 0
        state.commit()
    elif state.batch % args.batches_per_host_check == 0:
        state.check_host_updates()


device = "GPU" if args.cuda else "CPU"


@hvd.elastic.run
def run_benchmark(state: hvd.elastic.TorchState) -> None:
    if not state.warm:
        log("Running warmup...")
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
        state.warm = True
        state.commit()
    if state.iter == 0:
        log(f"Model: {args.model}")
        log(f"Batch size: {args.batch_size}")
        log("Running benchmark...")
    for x in range(state.iter, args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device} ({hvd.size()} {device}s)")
        state.img_secs.append(img_sec)
        state.iter = x + 1
        state.commit()


def on_state_reset() -> None:
    # The learning rate follows the world size.
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.01 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)

if state.img_secs:
    img_sec_mean = sum(state.img_secs) / len(state.img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f}")
