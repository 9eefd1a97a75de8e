"""The seam framework adapters build on (torch today; TensorFlow, JAX and others the same way).

An adapter turns its tensors into what the runtime moves and back, and supplies the
framework-shaped API on top. It imports only:

* `collective` (the user API: `init`, `rank`, `ProcessSet`, `ReduceOp`, errors, ...);
* this module, for everything an adapter needs beyond the user API;
* the public modules `collective.errors`, `collective.types` and `collective.elastic` (the
  worker side of elastic training: `State`, `ObjectState`, `run_fn`, `reset`).

Nothing else in `collective` is an adapter's to import (tests/unit/test_layering.py checks it).

Ops:
    `enqueue(kind, tensors, ...) -> Handle`: queue one op (or a grouped op) without waiting.
    `run_one(kind, tensor, output, name, ...)`: one single-tensor op, run and waited for (the
        synchronous functions; the calling thread runs the cycle when it can).
    `wait_now(sync, start, *args)`: `sync(start(*args))` for other synchronous functions, with
        the same fast paths.
    `splits_values(splits, name, rank)`: alltoall's splits checked by the rule every entry
        point shares (whole row counts; floats only when whole, never truncated), for an
        adapter that can check them before the op is queued (a graph being traced).
    `waiting_hook()`: the runtime's `waiting(+1/-1)`, to call around a blocking wait on a
        device op's handle (device requests are then negotiated at once).
    `gradient_set(names, shapes, dtypes, device, process_set, op, prescale, postscale)`: a
        fixed list of tensors allreduced every step, one op per member, without per-member
        requests and handles (collective/gradset.py); None where the job cannot run one.

Device seam (no CuPy here; the NCCL engine owns every CUDA call):
    `DeviceBuffer`, `DeviceResult`, `DeviceOpError`, `record_ready`, `on_stream`,
    `allocation_stream`; see `collective.engines.device`.

Configuration:
    `config()`: the running job's `Config` (the `HOROVOD_*` settings read at `init()`).
    `process_set_by_id(ps_id)`: the registered `ProcessSet` with that id (graph ops that
        name sets by id, as Horovod's TensorFlow ops do).
    `bucket_schedule(cap_mb, global_set, owner)`: for an optimizer that reduces its gradients
        in buckets, the schedule through which autotune changes the bucket size (None: keep
        it); it closes when `owner` is garbage-collected.
"""
from __future__ import annotations

from typing import Any, Callable

from ._current import current, current_or_none
from .config import Config
from .engines.device import (DeviceBuffer, DeviceOpError, DeviceResult, allocation_stream,
                             on_stream, record_ready)
from .gradset import GradientSet
from .gradset import register as gradient_set
from .ops import enqueue, reducescatter_op, run_one, splits_values, wait_now

__all__ = ["enqueue", "run_one", "wait_now", "splits_values", "reducescatter_op", "waiting_hook", "config",
           "process_set_by_id", "bucket_schedule",
           "gradient_set", "GradientSet",
           "DeviceBuffer", "DeviceResult", "DeviceOpError", "record_ready", "on_stream",
           "allocation_stream"]


def config() -> Config:
    """The running job's configuration.

    Raises:
        NotInitializedError: `init()` has not been called.
    """
    return current().config


def process_set_by_id(ps_id: int) -> Any:
    """The registered process set with id `ps_id`.

    Raises:
        ValueError: no set has that id; NotInitializedError: before `init()`.
    """
    return current().registered_set(ps_id)


def waiting_hook() -> Callable[[int], None] | None:
    """The coordinator's `waiting(delta)` (+1 before blocking on a device op's handle, -1
    after), or None before `init()`."""
    rt: Any = current_or_none()
    return getattr(getattr(rt, "coordinator", None), "waiting", None)


def bucket_schedule(cap_mb: float, global_set: bool, owner: Any = None) -> Any:
    """For an optimizer that just planned gradient buckets of `cap_mb` MB (`global_set`: it
    reduces over the global process set): the runtime's bucket schedule when autotune may change
    the bucket size, else None (keep `cap_mb`). With a schedule, the optimizer calls
    `schedule.step_done()` at the end of every `synchronize()`, on every rank, and re-plans its
    buckets before the next step when the size it returns differs
    (collective/coordinator/tuning.py says why every rank then switches at the same step).
    None before `init()`, without autotune, in elastic mode, for a second bucketed optimizer and
    for `cap_mb` <= 0. `owner`: the object that calls `step_done()` (weakly referenced: when it
    is garbage-collected, autotune stops tuning the bucket size instead of waiting for steps
    that will never come)."""
    rt: Any = current_or_none()
    tuning = getattr(getattr(rt, "coordinator", None), "tuning", None)
    if tuning is None:
        return None
    return tuning.register_buckets(cap_mb, global_set, owner)
