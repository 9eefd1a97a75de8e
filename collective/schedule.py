"""Pre-agreed bucket schedules: gradient buckets reduced on the GPU with no negotiation round.

Why: with negotiation, a rank whose backward ends first waits on its host in `step()` until the
slower rank has submitted its last bucket, because a stream cannot wait on an op that is not
launched yet (docs/gpu.md, "Open work"). DDP's reducer instead launches each bucket as soon as
it is ready and lets NCCL meet the peers on the GPU; the early host goes on queueing the next
step. A schedule does the same for `DistributedOptimizer`'s buckets once every rank agreed on
them:

* Agreement: after a first negotiated step (which checked every bucket's name, size and dtype on
  every rank), the adapter allgathers whether each rank can and wants to schedule, and rank 0's
  NCCL unique id; the schedule opens only if all say yes (`open_schedule`).
* Launch: slot k (bucket k) is launched when its data is queued and slots 0..k-1 are launched,
  on a communicator and stream of its own (`ScheduleComm`), so its order never interleaves with
  negotiated ops, which ranks may reach at different points.
* Heartbeat: each step ends with a tiny negotiated host allreduce (`<name>.step`, a sum of ones)
  that the next step waits for before its first launch. A step is ~tens of ms, so it is long
  done. It keeps what negotiation gave: a rank that stops stepping shows in the stall report,
  a dead peer fails it (tcp mode: the coordinator also aborts the communicator, so stuck
  kernels return), and a joined rank contributes 0, which ends the schedule on every rank:
  the joined rank's coordinator launches zeros for the step the others already launched
  (`launch_zeros`), and the others see a sum below the set's size and negotiate from then on.

Only the NCCL engine implements `ScheduleComm`; this module imports it on first use.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from . import _log
from . import runtime as _rt
from .ops import _PREFIX, enqueue
from .types import DataType, ReduceOp, RequestType

__all__ = ["BucketSchedule", "open_schedule", "refusal", "unique_id"]

_log_ = _log.get_logger()


def refusal(op: ReduceOp, name: str | None = None) -> str | None:
    """Why this process cannot open a schedule named `name` that reduces with `op` on its GPU
    (None: it can). A name in use by another active schedule is refused: their heartbeats
    would collide (two optimizers over the same parameters)."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return f"op {op.name} (a schedule reduces with Sum or Average)"
    rt = _rt.current_or_none()
    if name is not None and rt is not None and any(
            s.active and s.name == name for s in rt.schedules()):
        return f"another optimizer's schedule is named {name}"
    try:
        from .engines.nccl import nccl
        if op == ReduceOp.AVERAGE and int(nccl.get_version()) < 21000:
            return "NCCL older than 2.10 has no ncclAvg"
    except Exception as exc:  # noqa: BLE001 - no CuPy/NCCL: negotiate
        return f"NCCL engine unavailable ({exc})"
    return None


def unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) for `open_schedule`.

    Raises:
        EngineUnavailableError: CuPy or NCCL is missing.
    """
    from .engines.nccl import new_unique_id
    return new_unique_id()


class BucketSchedule:
    """One optimizer's agreed buckets on a communicator of their own. See the module docstring.

    Use per step: `begin()` before the first bucket (False: the schedule has ended, negotiate
    instead), `ready(slot, ptr, stream)` as each bucket is packed, `wait(slot, stream)` for
    each, then `finish()`.
    """

    def __init__(self, rt: Any, state: Any, process_set: Any, comm: Any, name: str,
                 slots: int) -> None:
        self.rt = rt
        self.state = state
        self.process_set = process_set
        self.comm = comm  # a ScheduleComm: it knows each slot's size, dtype and the op
        self.name = name
        self.active = True
        self.step_open = False
        self.steps = 0  # scheduled steps finished (tests and benchmarks read it)
        self._ptrs: list[int | None] = [None] * slots
        self._next = 0  # the next slot to launch this step
        self._beat: Any = None  # the last step's heartbeat handle
        # The heartbeat's name as the coordinator sees it (`enqueue` adds the op's prefix).
        self.beat_name = f"{_PREFIX[RequestType.ALLREDUCE]}.{name}.step"
        self._lock = threading.Lock()
        state.joined_hooks[self.beat_name] = self._on_joined

    # -- per step -------------------------------------------------------------------------------
    def begin(self) -> bool:
        """Before a step's first bucket: waits for the last step's heartbeat. False when the
        schedule ended (a rank joined, the runtime shut down); gradients are then negotiated.

        Raises:
            HorovodInternalError: the heartbeat or the communicator failed (e.g. a dead peer).
        """
        if self.step_open:
            return True
        with self._lock:  # hooks on several autograd threads may start a step at once
            return self._begin()

    def _begin(self) -> bool:
        if self.step_open:
            return True
        if not self.active:
            return False
        if self.rt is not _rt.current_or_none() or self.rt.shut_down:
            # An elastic reset (or shutdown and init): the adapter decides again after this
            # step, on every rank, as a new worker's optimizer does after its first step.
            self._end("the runtime was shut down")
            return False
        beat, self._beat = self._beat, None
        if beat is not None:
            alive = int(np.asarray(beat.wait()).reshape(-1)[0])
            if alive != self.state.size:
                self._end(f"{self.state.size - alive} rank(s) joined")
                return False
        self.comm.check()
        self.step_open = True
        return True

    def ready(self, slot: int, ptr: int, stream: int) -> None:
        """Slot `slot`'s data (`ptr`, its agreed size and dtype) is queued on `stream`; launches
        it and every later slot already ready, once the slots before it are launched.

        Raises:
            HorovodInternalError: the communicator failed.
        """
        with self._lock:
            self.comm.mark(slot, stream)
            ptrs = self._ptrs
            ptrs[slot] = ptr
            k, n = self._next, len(ptrs)
            while k < n and ptrs[k] is not None:
                self.comm.launch(k, ptrs[k])
                k += 1
            self._next = k

    def wait(self, slot: int, stream: int) -> None:
        """Makes `stream` wait for slot `slot`'s allreduce (no host block)."""
        self.comm.wait(slot, stream)

    def finish(self) -> None:
        """Ends the step (every slot launched) and submits its heartbeat."""
        assert self._next == len(self._ptrs), "bucket schedule: a step ended with slots unlaunched"
        self._ptrs = [None] * len(self._ptrs)
        self._next = 0
        self.step_open = False
        self.steps += 1
        ones = np.ones(1, dtype=np.int32)
        self._beat = enqueue(RequestType.ALLREDUCE, [ones], outputs=[ones],
                             name=f"{self.name}.step", process_set=self.process_set,
                             op=ReduceOp.SUM)

    # -- ending ---------------------------------------------------------------------------------
    def _on_joined(self) -> None:
        # Coordinator thread of a joined rank: the others launched this step's buckets; add
        # zeros so their kernels complete, then negotiate as they will.
        self.comm.launch_zeros()
        self._end("this rank joined")

    def _end(self, why: str) -> None:
        if not self.active:
            return
        self.active = False
        self.state.joined_hooks.pop(self.beat_name, None)
        _log_.info("bucket schedule %s ended (%s); its gradients are negotiated from now on",
                   self.name, why)

    def close(self) -> None:
        """At shutdown: waits for the stream, then destroys the communicator."""
        self.active = False
        self.comm.close()

    def abort(self) -> None:
        """When the job fails: aborts the communicator so that kernels waiting on a dead peer
        return."""
        self.active = False
        self.comm.abort()


def open_schedule(raw: bytes, process_set: Any, device: int, name: str,
                  specs: Sequence[tuple[int, DataType]], op: ReduceOp) -> BucketSchedule:
    """Opens a schedule on every rank of `process_set` (collective: each rank calls it with the
    same `raw` unique id, name and specs, after agreeing on them).

    Raises:
        CollectiveTimeoutError: the communicator init did not complete (a peer is missing).
        HorovodInternalError: NCCL refused it.
    """
    from .engines.nccl import ScheduleComm
    rt = _rt.current()
    state = rt.process_set_state(process_set, "DistributedOptimizer")
    comm = ScheduleComm(raw, device, state.size, state.rank, list(state.ranks), list(specs), op)
    sched = BucketSchedule(rt, state, process_set, comm, name, len(specs))
    rt.add_schedule(sched)
    return sched
