"""ringvod's TensorFlow 2 API, Horovod's `horovod.tensorflow`: `import horovod.tensorflow as hvd`.

Re-exports only: `mpi_ops` (collectives, eager and inside `tf.function`, with gradients),
`compression`, `functions` (broadcast helpers), `gradient_tape` (`DistributedGradientTape`),
`optimizer` (`DistributedOptimizer`), `sync_batch_norm`; the basics come from `collective`.
`hvd.callbacks` (the Keras callbacks) and `SyncBatchNormalization` load Keras on first use;
`hvd.elastic` (elastic training: `run`, `TensorFlowKerasState`, `TensorFlowState`) loads on
first use.
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

from . import mpi_ops
from .basics import init, shutdown
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (allgather, allreduce, alltoall, broadcast, broadcast_, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, join, local_rank_op,
                      local_size_op, process_set_included_op, rank_op, reducescatter, size_op)
from .optimizer import DistributedOptimizer

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Compression", "mpi_ops",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join",
    "broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_global_variables", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "SyncBatchNormalization", "callbacks", "keras", "elastic",
]

_LAZY = {"callbacks": ".keras.callbacks", "keras": ".keras", "elastic": ".elastic",
         "SyncBatchNormalization": ".sync_batch_norm"}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(target, __name__)
    value = module if name in ("callbacks", "keras", "elastic") else getattr(module, name)
    globals()[name] = value
    return value


def broadcast_global_variables(root_rank: int) -> None:
    """TF1's global-variable broadcast; TF2 has no global variables.

    Raises:
        RuntimeError: always (Horovod's TF2 behaviour).
    """
    raise RuntimeError("broadcast_global_variables() does not support eager execution. Please "
                       "use hvd.broadcast_variables(<model/optimizer variables>) instead.")
