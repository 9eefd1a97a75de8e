"""Horovod's `horovod.torch.mpi_ops` module: the basics and collectives under their old home.

Re-exports only (it also has `is_homogeneous`, which `horovod.torch` itself does not export).
"""
from collective import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                        Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                        ddl_built, global_process_set, gloo_built, gloo_enabled,
                        is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                        mpi_enabled, mpi_threads_supported, nccl_built, rank,
                        remove_process_set, rocm_built, size, start_timeline, stop_timeline)

from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                       grouped_allreduce, grouped_reducescatter, reducescatter)
from .compression import Compression
from .ops import (allgather_async, allreduce_, allreduce_async, allreduce_async_,
                  alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
                  grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_reducescatter_async, init, join, poll,
                  reducescatter_async, shutdown, sparse_allreduce_async, synchronize)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Compression",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "poll",
    "synchronize",
]
