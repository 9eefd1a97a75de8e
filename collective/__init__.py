"""ringvod's runtime at the numpy level: `import collective as hvd`.

Re-exports only; see `basics` (lifecycle, topology, process sets), `ops` (collectives),
`errors`, `handle` and `process_sets`.
"""
from .basics import (add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                     gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
                     local_size, mode, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                     rank, remove_process_set, rocm_built, shutdown, size, start_timeline,
                     stop_timeline)
from .errors import (CollectiveError, CollectiveTimeoutError, DuplicateNameError,
                     EngineUnavailableError, HorovodInternalError, HostsUpdatedInterrupt,
                     MismatchError, NotInitializedError, ShutdownError, StallError)
from .handle import Handle
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                  allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                  alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                  broadcast_async_, enqueue, grouped_allgather, grouped_allgather_async,
                  grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
                  join, poll, reducescatter, reducescatter_async, resolve_op, synchronize)
from .process_sets import ProcessSet, global_process_set
from .types import DataType, ReduceOp, RequestType

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mode", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline",
    "CollectiveError", "CollectiveTimeoutError", "DuplicateNameError", "EngineUnavailableError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "MismatchError", "NotInitializedError",
    "ShutdownError", "StallError", "Handle",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_async",
    "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier",
    "join", "poll", "synchronize", "enqueue", "resolve_op",
    "ProcessSet", "global_process_set", "DataType", "ReduceOp", "RequestType", "__version__",
]
