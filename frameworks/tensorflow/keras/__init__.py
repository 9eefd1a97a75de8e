"""ringvod's Keras 3 API, Horovod's `horovod.tensorflow.keras` and `horovod.keras` (the same
module): `import horovod.tensorflow.keras as hvd`.

Re-exports: the basics (from `collective`), `DistributedOptimizer`,
`PartialDistributedOptimizer`, `load_model` (`optimizer`), the callbacks (`callbacks`), and
`allreduce` / `allgather` / `broadcast` / `reducescatter` on values (eager tensors back), and
`elastic` (elastic training: `run`, `KerasState`, the commit/update callbacks), loaded on first
use.
"""
from __future__ import annotations

import importlib
from typing import Any

from collective import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                        Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                        ddl_built, global_process_set, gloo_built, gloo_enabled,
                        is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                        mpi_enabled, mpi_threads_supported, nccl_built, rank,
                        remove_process_set, rocm_built, size, start_timeline, stop_timeline)

from .. import mpi_ops as _ops
from ..compression import Compression
from ..functions import broadcast_object, broadcast_variables
from ..basics import init, shutdown
from . import callbacks
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Compression", "DistributedOptimizer",
    "PartialDistributedOptimizer", "load_model", "callbacks", "broadcast_global_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_object",
    "broadcast_variables", "elastic",
]


def __getattr__(name: str) -> Any:
    if name != "elastic":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(".elastic", __name__)
    globals()[name] = module
    return module


def broadcast_global_variables(root_rank: int) -> None:
    """TF1's global-variable broadcast; TF2 has no global variables.

    Raises:
        RuntimeError: always (Horovod's TF2 behaviour); use the callback or
            `broadcast_variables`.
    """
    raise RuntimeError("broadcast_global_variables() does not support eager execution. Please "
                       "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "hvd.broadcast_variables(model.variables + optimizer.variables, "
                       "root_rank) instead.")


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Any = None, compression: Any = Compression.none) -> Any:
    """Allreduces a tensor-compatible value (array, number, tensor); returns a tensor."""
    return _ops.allreduce(value, average=average, compression=compression, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          name=name)


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenates every rank's value along dim 0; returns a tensor."""
    return _ops.allgather(value, name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Rank `root_rank`'s value on every rank; returns a tensor."""
    return _ops.broadcast(value, root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> Any:
    """Reduces, then returns this rank's share of dim 0; returns a tensor."""
    return _ops.reducescatter(value, name=name, op=op)
