"""ringvod's PyTorch API, Horovod's `horovod.torch`: `import horovod.torch as hvd`.

Re-exports only: `ops` (async, in-place and control collectives), `autograd` (differentiable
collectives), `compression`, `functions` (broadcast helpers), `optimizer`
(`DistributedOptimizer`), `sync_batch_norm`, `elastic` (elastic training); the basics come from
`collective`.
"""
try:
    import torch as _torch  # noqa: F401 - fail here, with the fix, rather than deep inside
except ImportError as _exc:
    raise ModuleNotFoundError(
        "horovod.torch needs PyTorch, which is not installed. Install it with `pip install "
        "torch` (the CPU-only build: `pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu`), or from your ringvod clone with `pip install "
        "\".[torch]\"` (see README.md, Install)", name="torch") from _exc
from collective import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                        Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                        ddl_built, global_process_set, gloo_built, gloo_enabled,
                        is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                        mpi_threads_supported, nccl_built, rank, remove_process_set,
                        rocm_built, size, start_timeline, stop_timeline)

from . import elastic, mpi_ops
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                       grouped_allreduce, grouped_reducescatter, reducescatter)
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (allgather_async, allreduce_, allreduce_async, allreduce_async_,
                  alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
                  grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_reducescatter_async, init, join, poll,
                  reducescatter_async, shutdown, sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Compression", "elastic", "mpi_ops",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
    "synchronize", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "SyncBatchNorm",
]
