"""ringvod's JAX API for host (CPU) arrays: `import horovod.jax as hvd` (or `frameworks.jax`).

Horovod has no JAX API; this one follows `horovod.torch`'s names and signatures where they fit
immutable arrays (no in-place forms). Re-exports only: `ops` (collectives and their `_async`
forms), `functions` (`broadcast_variables`, `allreduce_gradients`, object helpers),
`optimizer` (`DistributedOptimizer` for optax), `compression`; the basics come from
`collective`. See docs/jax.md.
"""
try:
    import jax as _jax  # noqa: F401 - fail here, with the fix, rather than deep inside
except ImportError as _exc:
    raise ModuleNotFoundError(
        "horovod.jax needs JAX, which is not installed. Install it with `pip install jax` (the "
        "CPU build), or from your ringvod clone with `pip install \".[jax]\"` (see README.md, "
        "Install)", name="jax") from _exc
from collective import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                        Sum, add_process_set, barrier, ccl_built, cross_rank, cross_size,
                        cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled,
                        init, is_homogeneous, is_initialized, join, local_rank, local_size,
                        mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                        remove_process_set, rocm_built, shutdown, size, start_timeline,
                        stop_timeline)

from .._common import process_set_rank, process_set_size
from ._arrays import JaxHandle
from .compression import Compression
from .functions import (allgather_object, allreduce_gradients, broadcast_object,
                        broadcast_variables)
from .ops import (allgather, allgather_async, allreduce, allreduce_async, alltoall,
                  alltoall_async, broadcast, broadcast_async, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                  grouped_reducescatter, grouped_reducescatter_async, poll, reducescatter,
                  reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "process_set_size", "process_set_rank",
    "Compression", "JaxHandle",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier",
    "join", "poll", "synchronize", "broadcast_variables", "allreduce_gradients",
    "broadcast_object", "allgather_object", "DistributedOptimizer",
]
