"""The coordinator: one named background thread per process that negotiates and executes.

A cycle (`Coordinator.run_cycle`) negotiates each process set's queued requests
(collective/coordinator/negotiate.py) and executes the agreed responses in the same order on
every rank (execute.py). The thread loops over `run_cycle` and waits between cycles for new
work or the cycle time, whichever comes first (`_loop`, `_device_hold`); a synchronous op may
run its cycle on its own thread instead (fastpath.py).

When a cycle raises (an engine error, a dead peer), every pending handle fails with that cause
and later submits raise `ShutdownError`.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .. import _log
from ..types import CPU_DEVICE, RequestType, Response
from .execute import perform
from .fastpath import FastPaths
from .negotiate import Negotiator, check_stall
from .state import ProcessSetState
from .tuning import Tuning

if TYPE_CHECKING:
    from ..runtime import Runtime

__all__ = ["Coordinator", "HELD"]

_log_ = _log.get_logger()

# While tensors are pending but nothing completed, wait at most this long before negotiating
# again (a submit wakes the thread at once): short enough to meet peers that are about to
# submit, long enough not to steal the GIL from the training thread.
_BUSY_WAIT = 0.0002
# With nothing pending on this rank, the longest sleep between negotiations (see _loop).
_IDLE_WAIT = 0.05
# Device requests collect up to this many bytes before a negotiation starts early (DDP's
# bucket size is 25 MB).
_DEVICE_BUCKET = 32 * 1024 * 1024
# A request this large (a DistributedOptimizer bucket) is negotiated without a fusion window.
_NO_HOLD_BYTES = 512 * 1024
# Request types whose device requests collect for a fusion window (`_device_hold`).
HELD = (RequestType.ALLREDUCE, RequestType.REDUCESCATTER)


class Coordinator(FastPaths):
    """Owns the background thread. `run_cycle()` is one step, testable without the thread."""

    def __init__(self, runtime: "Runtime") -> None:
        self.rt = runtime
        self.config = runtime.config
        # The fusion threshold and cycle time in force (autotune changes them: tuning.py).
        self.tuning = Tuning(runtime.config)
        self.negotiator = Negotiator(runtime.config, self.tuning)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.shutdown_requested = False  # set by user threads; read each cycle
        self.stopped = threading.Event()
        self.timeline: Any = None  # collective.timeline.Timeline on global rank 0
        self._idle_cycles = 0
        # Device fusion window (see _device_hold): threads blocked on a device op's handle,
        # when the queued device requests started collecting, and a scan cursor per queue.
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._hold_since: float | None = None
        self._scanned: dict[int, tuple[Any, int, int]] = {}  # ps id -> (queue, len, bytes)
        self._init_fast_paths()
        self._thread_id: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        rt = self.rt
        # What the express lane needs that cannot change while the job runs: the response
        # cache, and one fixed process set (its round covers one set).
        self._express_ok = (not rt.dynamic_process_sets and len(rt.member_sets()) == 1
                            and all(ps.cache.capacity > 0 for ps in rt.member_sets()))
        self.tuning.start(rt.rank)
        thread = threading.Thread(target=self._loop, name="hvd-coordinator", daemon=True)
        try:
            thread.start()
        except BaseException:
            self.tuning.close()  # the loop that would close the autotune log never runs
            raise
        # Only a started thread: `join` then has a thread to wait for (a failed start leaves
        # None, which `join` treats as stopped).
        self._thread = thread
        self._thread_id = thread.ident

    def wake(self, held: bool = False) -> None:
        """New work. `held`: only device reductions, which the fusion window collects anyway;
        while a window is open they do not wake the thread (each wake-up costs the submitting
        gradient hook a GIL hand-off)."""
        if held and self._hold_since is not None:
            return
        if not self._wake.is_set():  # setting an Event takes its lock; most submits find it set
            self._wake.set()

    def waiting(self, delta: int) -> None:
        """A user thread starts (+1) or stops (-1) blocking on a device op's handle. While one
        waits, device requests are negotiated at once instead of collecting for a window."""
        with self._waiters_lock:
            self._waiters += delta
        # Wake a thread that may be collecting; with nothing queued the submit will wake it
        # (waking it now would cost an empty negotiation round).
        if delta > 0 and (self._hold_since is not None
                          or any(ps.queue for ps in self.rt.member_sets())):
            self._wake.set()

    def _has_work(self) -> bool:
        """Something for a cycle to do on this rank: queued or pending ops, a shutdown to
        announce, process-set changes."""
        return (self.shutdown_requested or self.rt.has_changes()
                or any(ps.queue or ps.pending() for ps in self.rt.member_sets()))

    def _device_hold(self) -> float:
        """Seconds to keep collecting queued device reductions before negotiating (0 = now).

        Gradient hooks submit one tensor at a time during backward; negotiating each at once
        costs a cycle and an NCCL launch per tensor (measured: ~120 responses per ResNet-50
        step, the coordinator busy for most of the step). Device allreduce/reducescatter
        requests therefore collect for up to one cycle time from the first, as Horovod's
        cycle does, unless they already fill a bucket, other work is queued, a shutdown is
        requested, or a thread is blocked on a device handle (a synchronize wants them now).
        """
        window = self.tuning.cycle_time
        bucket = min(self.tuning.fusion_threshold, _DEVICE_BUCKET)
        sets = self.rt.member_sets()
        if (window <= 0 or bucket <= 0 or self._waiters > 0 or self.shutdown_requested
                or not any(ps.queue or _set_news(ps) for ps in sets)):  # no lock needed
            self._hold_since = None
            return 0.0
        total = 0
        for ps in sets:
            for gs in ps.sets:  # gradient sets: their new submits collect like requests
                if gs.new_bytes:
                    if gs.device == CPU_DEVICE:
                        self._hold_since = None
                        return 0.0
                    total += gs.new_bytes
            with ps.lock:
                q = ps.queue
                old, seen, nbytes = self._scanned.get(ps.id, (None, 0, 0))
                if old is not q or seen > len(q):
                    seen, nbytes = 0, 0
                for req in q[seen:]:
                    rbytes = req.num_elements() * req.dtype.itemsize
                    # Host work, other op types and already-bucketed gradients go at once.
                    if (req.device == CPU_DEVICE or req.type not in HELD
                            or rbytes >= _NO_HOLD_BYTES):
                        self._hold_since = None
                        return 0.0
                    nbytes += rbytes
                self._scanned[ps.id] = (q, len(q), nbytes)
            total += nbytes
        if total == 0 or total >= bucket:
            self._hold_since = None
            return 0.0
        now = time.monotonic()
        if self._hold_since is None:
            self._hold_since = now
        left = self._hold_since + window - now
        if left <= 0:
            self._hold_since = None
            return 0.0
        return left

    def request_shutdown(self) -> None:
        self.shutdown_requested = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is None or self._thread is threading.current_thread():
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        cause: BaseException | None = None
        try:
            self.rt._pin_thread()
            timed_out = True  # the first cycle always runs
            while True:
                cycle = self.tuning.cycle_time  # autotune may change it between cycles
                start = time.monotonic()
                self._wake.clear()
                if self._handoff is not None or self._ended_by_driver:
                    with self._cycle_lock:
                        if self._handoff is not None:  # a cycle on a user thread failed
                            raise self._handoff
                        self._loop_over = True
                        break  # a cycle on a user thread agreed to shut down
                hold = self._device_hold()
                if hold > 0:
                    self._wake.wait(hold)
                    continue
                with self._cycle_lock:
                    if self._handoff is not None:  # a cycle on a user thread failed
                        raise self._handoff
                    if self._ended_by_driver:
                        self._loop_over = True
                        break
                    # Woken with nothing to do (a waiting thread already drove the cycle):
                    # an empty negotiation round would only make the peers wait for it.
                    if (timed_out or self._has_work()) and not self.run_cycle():
                        self._loop_over = True
                        break
                if any(ps.pending() for ps in self.rt.member_sets()) or self.rt.has_changes():
                    timed_out = True  # pending work: cycle again whatever wakes us
                    if self._idle_cycles == 0:  # progress: more is likely ready at once
                        continue
                    remaining = min(cycle - (time.monotonic() - start), _BUSY_WAIT)
                    if remaining > 0:
                        self._wake.wait(remaining)
                elif self.rt.size == 1:
                    self._wake.wait()  # nobody else needs us: sleep until work arrives
                    timed_out = False
                else:
                    # Idle: a peer's op cannot complete without our own submit of it, which
                    # wakes us, so only shutdown and stall reports need periodic cycles.
                    # Every wake-up takes the GIL from the training thread.
                    timed_out = not self._wake.wait(max(cycle, _IDLE_WAIT))
        except BaseException as exc:  # noqa: BLE001 - everything pending must learn the cause
            cause = exc
            _log_.error("Horovod background loop uncaught exception: %s", exc, exc_info=True)
            for ps in self.rt.member_sets():
                try:
                    ps.control.abort(str(exc))
                except Exception:  # noqa: BLE001
                    pass
                if ps.device_engine is not None:  # GPU kernels stuck on a dead peer return
                    try:
                        ps.device_engine.abort()
                    except Exception:  # noqa: BLE001
                        pass
            # No cycle starts on a user thread from here on. One that began before this is
            # waited for (briefly: its control plane was aborted, though MPI's cannot be), so
            # that the op it put in the table is there when the exit below fails them all.
            self._loop_over = True
            if self._cycle_lock.acquire(timeout=2.0):
                self._cycle_lock.release()
        finally:
            try:
                self.rt._on_loop_exit(cause)
                self.tuning.close()  # autotune's CSV log, if tuning had not ended
            finally:
                self.stopped.set()

    # -- one cycle ----------------------------------------------------------------------------
    def run_cycle(self) -> bool:
        """Negotiates and executes once for every process set; False when the job shuts down."""
        tl = self.timeline
        if tl is not None:
            tl.mark_cycle()  # a no-op unless cycle marking is on
        if self.rt.dynamic_process_sets:
            self.rt._sync_process_set_changes()
        progress = False
        for ps in self.rt.member_sets():
            responses, shutdown = self._negotiate(ps)
            for resp in responses:
                self._perform(ps, resp)
                progress = True
            if shutdown:
                return False
        self._idle_cycles = 0 if progress else self._idle_cycles + 1
        return True

    def _negotiate(self, ps: ProcessSetState) -> tuple[list[Response], bool]:
        if ps.is_root and check_stall(ps):
            self.shutdown_requested = True  # travels with the next global negotiation
            self.negotiator.stall_shutdown = True
            ps.control.end_stalled_job(f"rank {self.rt.rank}: a rank stalled longer than "
                                       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                       self.rt.rank in ps.stall.shutdown_ranks)
        if ps.sets and any(s.stalled for s in ps.sets):
            self.shutdown_requested = True  # a gradient set's stall (collective/gradset.py)
            self.negotiator.stall_shutdown = True
            ps.control.end_stalled_job(f"rank {self.rt.rank}: a rank stalled in a gradient "
                                       "set longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                       False)
        return self.negotiator.round(ps, ps.timeline, self.shutdown_requested and ps.id == 0)

    # -- execution ----------------------------------------------------------------------------
    def _perform(self, ps: ProcessSetState, resp: Response) -> None:
        perform(ps, resp, ps.timeline, self.rt.device_engine_name, self.config, self.tuning.driver)


def _set_news(ps: ProcessSetState) -> bool:
    """Some gradient set of `ps` has submits not yet taken into a round."""
    return any(gs.new_bytes for gs in ps.sets)
