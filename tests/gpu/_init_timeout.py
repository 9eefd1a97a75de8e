"""A communicator init that cannot complete times out with a clear message on every rank.

Rank 1 throws away the unique id it receives and makes its own, so the two ranks wait for
different communicators; with COMM_INIT_TIMEOUT=5 both must raise CollectiveTimeoutError (a
HorovodInternalError) naming the timeout. Run at 2 ranks by tests/gpu/test_gpu_ops.py.
"""
import os
import sys

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
             ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import torch  # noqa: E402

import collective.engines.nccl.comm as comm  # noqa: E402
import collective.engines.nccl.engine as engine  # noqa: E402
import frameworks.torch as hvd  # noqa: E402

comm.COMM_INIT_TIMEOUT = 5.0
hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
if hvd.rank() == 1:
    real = engine.exchange_unique_id
    engine.exchange_unique_id = lambda control: (real(control),
                                                 comm._uid_bytes(comm.nccl.get_unique_id()))[1]
try:
    hvd.allreduce(torch.ones(4, device="cuda"), name="never")
except hvd.HorovodInternalError as exc:
    ok = "did not complete within" in str(exc)
    print(f"rank {hvd.rank()}: {type(exc).__name__}: {exc}", flush=True)
    # os._exit: the abandoned init thread is still inside NCCL; do not risk a hang at exit.
    os._exit(0 if ok else 5)
print(f"rank {hvd.rank()}: no error", flush=True)
os._exit(6)
