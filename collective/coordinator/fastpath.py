"""The fast paths: a cycle run on the user thread that is about to wait for its own op.

A synchronous function (`allreduce`, `allreduce_`, `broadcast_`, ...) waits for its op at
once, so handing the op to the coordinator thread and being woken again (two thread hand-offs)
is most of a lone op's latency. `collective.ops.run_one` and `wait_now` use two paths instead:

* **express** (`FastPaths.express`): the op's request is a cache hit and this rank has nothing
  else in flight (no queued, pending or carried requests, one fixed process set, no join, no
  stall check due, no timeline on this rank). The entry goes into the tensor table and one
  ordinary cache-path round with just its bit runs on the caller's thread; peers running
  ordinary cycles take part as in any round. If every rank has the bit the op runs at once;
  anything else the round brings goes through the ordinary round code and the op then waits
  as a cache hit.
* **drive** (`FastPaths.drive`): otherwise the op is queued without waking the coordinator
  thread, and the caller runs one ordinary cycle itself when no cycle is running.

Cycles never overlap (`_cycle_lock`). Left to the coordinator thread: the first device op (it
binds the GPU to that thread) and host ops that allocate an output of `_DRIVE_ALLOC_LIMIT`
bytes or more. What a cycle on a user thread raises, or a shutdown it agrees on, is handed to
the coordinator thread, whose loop ends the job as if it had happened there.

`FastPaths` is a part of `Coordinator` (collective/coordinator/loop.py), kept here so the
coordinator's own loop reads on its own.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..entry import Entry
from ..negotiation import CacheState
from ..types import CPU_DEVICE, Request
from .negotiate import ALL_CLEAR, NOT_RETUNE
from .state import ProcessSetState

__all__ = ["FastPaths"]

# A host op with a new output this large runs on the coordinator thread, not a driving caller.
_DRIVE_ALLOC_LIMIT = 64 * 1024
_HIT = CacheState.HIT


class FastPaths:
    """The express lane and driven cycles of `Coordinator` (which calls `_init_fast_paths`)."""

    def _init_fast_paths(self) -> None:
        # Cycles may also run on a user thread that is about to block on its op (`drive`):
        # one cycle at a time, under this lock; what such a cycle raises or decides (shutdown)
        # is handed to the coordinator thread, whose loop ends the job as usual.
        self._cycle_lock = threading.Lock()
        self._handoff: BaseException | None = None
        self._ended_by_driver = False
        # Set, under the lock, when the coordinator's loop leaves: from then on no cycle may
        # start on a user thread (its round would wait for peers that stopped, and the loop's
        # exit has failed, or is about to fail, every pending op).
        self._loop_over = False
        # Express rounds run (diagnostics: benchmarks and tests read them), and how many of
        # them did not agree on the op, which then waited as an ordinary cache hit.
        self.express_rounds = 0
        self.express_waits = 0
        self._express_ok = False  # set by start()

    def drive(self) -> None:
        """Runs one cycle on the calling thread if no cycle is running, for a thread about to
        block on an op it just submitted: it saves two thread hand-offs (the wake-up of the
        coordinator thread and the wake-up of the caller) on a lone synchronous op.

        Whatever the cycle raises, or a shutdown it agrees on, goes to the coordinator thread,
        which ends the job as when the error happened there (a cycle cut short leaves the
        peers mid-negotiation); the caller's handle fails with it. A KeyboardInterrupt or
        SystemExit is also raised again in the caller. Afterwards the coordinator thread is
        woken if work is left."""
        if self.stopped.is_set() or self._thread is threading.current_thread():
            return
        sets = self.rt.member_sets()
        device = _device_engine(sets)
        if any(_left_to_coordinator(ps, device is not None) for ps in sets):
            self._wake.set()
            return
        if self._cycle_lock.acquire(blocking=False):
            self._guest(self.run_cycle, device)
        else:  # a cycle is running; make sure one runs after it for our op
            self._wake.set()

    def express(self, ps: ProcessSetState, entry: Entry) -> bool:
        """Negotiates and runs one op on the calling thread, for a synchronous function whose
        request is a cache hit while this rank has nothing else in flight (a lone synchronous
        op, e.g. `hvd.allreduce_(x, name=...)`): the entry goes into the tensor table, the
        round sends just its bit, and when every rank has it the op runs at once. The round is
        an ordinary cache-path round, so peers running ordinary cycles take part as usual.
        Anything else the round brings (a peer's uncached request, a mismatch, a shutdown, the
        bit missing on some rank) is handled by the ordinary cycle code, and the entry then
        waits like a submitted one. False (nothing done) when the conditions do not hold; the
        caller then submits the entry (a name already pending is refused there).
        """
        # Checked in order of cost: this runs for every synchronous op, whose whole host path
        # is a few dozen Python calls.
        if (self.shutdown_requested or ps.join_active or not self._express_ok
                or ps.timeline is not None
                or self._thread_id == threading.get_ident() or self.stopped.is_set()):
            return False
        req = entry.request
        device = ps.device_engine
        if (_coordinator_only(req, entry.output is None, device is not None)
                or not self._cycle_lock.acquire(False)):
            return False
        try:
            go = (self._handoff is None and not self._ended_by_driver and not self._loop_over
                  and not ps.queue
                  and not ps.hits and not ps.carry and not any(s.busy() for s in ps.sets)
                  and (ps.stall is None or not ps.stall.due()))
            if go:
                state, bit = ps.cache.lookup(req)
                go = state is _HIT
            if go:
                with ps.lock:
                    go = not ps.table
                    if go:
                        ps.table[req.name] = entry
        except BaseException:
            self._cycle_lock.release()
            raise
        if not go:
            self._cycle_lock.release()
            return False
        self._guest(self._express_round, device, ps, req, bit)
        return True

    def _express_round(self, ps: ProcessSetState, req: Request, bit: int) -> bool:
        # Gradient sets' words (after the cache's) stay 0: none of their members is pending.
        words = np.zeros(1 + (ps.cache.num_bits + 63) // 64 + ps.set_words(), dtype=np.uint64)
        # A round like any: global rank 0 with new autotune parameters clears the retune bit,
        # and the round then ends through `conclude`, which switches them.
        words[0] = ALL_CLEAR ^ NOT_RETUNE if self.tuning.wants_retune(ps) else ALL_CLEAR
        word = 1 + bit // 64
        words[word] = 1 << (bit % 64)
        res = ps.control.allreduce_words(words, "and")
        agreed = res.tolist()  # numpy scalars are slow; a few Python ints
        self.express_rounds += 1
        if agreed[0] == ALL_CLEAR and agreed[word] >> (bit % 64) & 1:
            self._perform(ps, ps.cache.get(bit))
            self._idle_cycles = 0
            return True
        self.express_waits += 1
        # Not agreed in this round: the entry waits as a cache hit, and the round ends as any.
        ps.hits.add(bit, req, time.monotonic())
        responses, shutdown = self.negotiator.conclude(ps, res, [], set(), False, ps.timeline)
        for resp in responses:
            self._perform(ps, resp)
        return not shutdown

    def _guest(self, cycle: Any, device: Any, *args: Any) -> None:
        """Runs `cycle(*args)` (a cycle's work; False = the job shuts down) on a user thread
        that holds `_cycle_lock` (released here). `device`: a device engine of this runtime, or
        None before the first device op. See `drive` for what happens to its outcome."""
        interrupt: BaseException | None = None
        try:
            if self._handoff is None and not self._ended_by_driver and not self._loop_over:
                try:
                    # A device engine may make its GPU and stream current on the thread it
                    # runs on: the thread gets its own back afterwards.
                    if device is not None:
                        device.guest_enter()
                    if not cycle(*args):
                        self._ended_by_driver = True
                except BaseException as exc:  # noqa: BLE001 - the loop ends the job
                    self._handoff = exc
                    if not isinstance(exc, Exception):
                        interrupt = exc
                finally:
                    if device is not None:
                        device.guest_exit()
        finally:
            self._cycle_lock.release()
        if (self._handoff is not None or self._ended_by_driver
                or any(ps.pending() for ps in self.rt.member_sets())):
            self._wake.set()
        if interrupt is not None:
            raise interrupt


def _device_engine(sets: list[ProcessSetState]) -> Any:
    """A device engine of this runtime (created by its first device op), or None."""
    for ps in sets:
        if ps.device_engine is not None:
            return ps.device_engine
    return None


def _left_to_coordinator(ps: ProcessSetState, gpu_bound: bool) -> bool:
    """Whether some queued op must run on the coordinator thread (`_coordinator_only`)."""
    for r in ps.queue:
        e = ps.table.get(r.name)  # a dict read needs no lock
        if _coordinator_only(r, e is None or e.output is None, gpu_bound):
            return True
    # A gradient set's first device op binds the GPU as well.
    return not gpu_bound and any(s.device != CPU_DEVICE and s.busy() for s in ps.sets)


def _coordinator_only(req: Request, new_output: bool, gpu_bound: bool) -> bool:
    """Whether an op should run on the coordinator thread rather than a user thread (a driven
    cycle or the express lane):

    * the first device op (`gpu_bound` False): it binds the GPU to the coordinator thread;
    * a host op that needs a new output of `_DRIVE_ALLOC_LIMIT` bytes or more: on the main
      thread glibc's main arena gives freed memory at the top of the heap back to the OS, so
      every new output page-faults in again (`benchmarks/allreduce_cpu.py`: a new-array 1 MiB
      allreduce took twice as long with such ops driven).
    """
    if req.device != CPU_DEVICE:
        return not gpu_bound
    return new_output and req.num_elements() * req.dtype.itemsize >= _DRIVE_ALLOC_LIMIT
