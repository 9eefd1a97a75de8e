"""ringvod's runtime at the numpy level: `import collective as hvd`.

Re-exports only, resolved on first use (PEP 562): `import collective.config` (what the launcher
needs) stays standard-library only, and `import collective` costs almost nothing until an op or
query is used. See `basics` (lifecycle, topology, process sets), `ops` (collectives), `errors`,
`handle` and `process_sets`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    # basics
    "add_process_set": "basics",
    "ccl_built": "basics",
    "cross_rank": "basics",
    "cross_size": "basics",
    "cuda_built": "basics",
    "ddl_built": "basics",
    "gloo_built": "basics",
    "gloo_enabled": "basics",
    "init": "basics",
    "is_homogeneous": "basics",
    "is_initialized": "basics",
    "local_rank": "basics",
    "local_size": "basics",
    "mode": "basics",
    "mpi_built": "basics",
    "mpi_enabled": "basics",
    "mpi_threads_supported": "basics",
    "nccl_built": "basics",
    "rank": "basics",
    "remove_process_set": "basics",
    "rocm_built": "basics",
    "shutdown": "basics",
    "size": "basics",
    "start_timeline": "basics",
    "stop_timeline": "basics",
    # errors
    "CollectiveError": "errors",
    "CollectiveTimeoutError": "errors",
    "DuplicateNameError": "errors",
    "EngineUnavailableError": "errors",
    "HorovodInternalError": "errors",
    "HostsUpdatedInterrupt": "errors",
    "MismatchError": "errors",
    "NotInitializedError": "errors",
    "ShutdownError": "errors",
    "StallError": "errors",
    # handle
    "Handle": "handle",
    # ops
    "Adasum": "ops",
    "Average": "ops",
    "Max": "ops",
    "Min": "ops",
    "Product": "ops",
    "Sum": "ops",
    "allgather": "ops",
    "allgather_async": "ops",
    "allreduce": "ops",
    "allreduce_": "ops",
    "allreduce_async": "ops",
    "allreduce_async_": "ops",
    "alltoall": "ops",
    "alltoall_async": "ops",
    "barrier": "ops",
    "broadcast": "ops",
    "broadcast_": "ops",
    "broadcast_async": "ops",
    "broadcast_async_": "ops",
    "grouped_allgather": "ops",
    "grouped_allgather_async": "ops",
    "grouped_allreduce": "ops",
    "grouped_allreduce_": "ops",
    "grouped_allreduce_async": "ops",
    "grouped_allreduce_async_": "ops",
    "grouped_reducescatter": "ops",
    "grouped_reducescatter_async": "ops",
    "join": "ops",
    "poll": "ops",
    "reducescatter": "ops",
    "reducescatter_async": "ops",
    "resolve_op": "ops",
    "synchronize": "ops",
    # process_sets
    "ProcessSet": "process_sets",
    "global_process_set": "process_sets",
    # types
    "DataType": "types",
    "ReduceOp": "types",
    "RequestType": "types",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names resolve lazily
    from .basics import (  # noqa: F401
        add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
        gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mode,
        mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
        rocm_built, shutdown, size, start_timeline, stop_timeline)
    from .errors import (  # noqa: F401
        CollectiveError, CollectiveTimeoutError, DuplicateNameError, EngineUnavailableError,
        HorovodInternalError, HostsUpdatedInterrupt, MismatchError, NotInitializedError,
        ShutdownError, StallError)
    from .handle import (  # noqa: F401
        Handle)
    from .ops import (  # noqa: F401
        Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
        allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
        broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
        grouped_allgather_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
        grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async, join,
        poll, reducescatter, reducescatter_async, resolve_op, synchronize)
    from .process_sets import (  # noqa: F401
        ProcessSet, global_process_set)
    from .types import (  # noqa: F401
        DataType, ReduceOp, RequestType)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        try:  # a submodule, e.g. collective.runtime
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
    "join", "poll", "synchronize", "resolve_op",
    "ProcessSet", "global_process_set", "DataType", "ReduceOp", "RequestType", "__version__",
]
