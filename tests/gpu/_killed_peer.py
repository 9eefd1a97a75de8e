"""Rank 1 SIGKILLs itself in the middle of GPU allreduces (argv[1] "allreduce") or of
DistributedOptimizer steps ("train", gradient buckets in flight); the job must end, not hang.

Run by tests/gpu/test_gpu_ops.py::test_gpu_killed_peer_ends_job (2 ranks). The launcher (mpirun
or hvdrun) ends the job when a rank dies; in tcp mode rank 0's control plane also fails with
HorovodInternalError and the NCCL communicator is aborted instead of spinning.
"""
import os
import signal
import sys

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
             ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import torch  # noqa: E402

import frameworks.torch as hvd  # noqa: E402

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
what = sys.argv[1] if len(sys.argv) > 1 else "allreduce"
x = torch.ones(1 << 20, device="cuda")
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 512)).cuda()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
try:
    for i in range(2000):
        if hvd.rank() == 1 and i == 20:
            print("rank 1: killing myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "train":
            opt.zero_grad()
            model(x.view(-1, 512)).square().mean().backward()
            opt.step()
        else:
            hvd.allreduce_(x, op=hvd.Average, name="killed.peer")
        torch.cuda.synchronize()
except hvd.HorovodInternalError as exc:
    print(f"rank {hvd.rank()}: HorovodInternalError: {exc}", flush=True)
    os._exit(3)
print(f"rank {hvd.rank()}: finished without noticing the dead peer", flush=True)
sys.exit(4)
