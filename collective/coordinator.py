"""The coordinator: one named background thread per process that negotiates and executes.

A cycle (`run_cycle`) drains each process set's queue, negotiates which names are ready on every
rank (cache fast path: one bitwise-AND of a word vector; slow path: gather requests to the set's
rank 0, which validates, orders and fuses, then broadcasts the responses), and executes the
responses in the same order on every rank. The thread loops over `run_cycle` and waits between
cycles for new work or the cycle time, whichever comes first.

Only this thread talks to control planes and engines. When a cycle raises (an engine error, a dead
peer), every pending handle fails with that cause and later submits raise `ShutdownError`.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _log, autotune
from .engines import create_engine
from .engines.device import release_ready
from .entry import Entry
from .errors import HorovodInternalError, MismatchError, ShutdownError
from .fusion import plan_fusion
from .handle import Handle
from .negotiation import (CACHEABLE, EVICTION_WARNING, CacheState, MessageTable, PendingHits,
                          ResponseCache, decode_gathered, decode_responses, encode_requests,
                          encode_responses)
from .stall import StallInspector
from .types import CPU_DEVICE, Request, RequestType, Response, ResponseType

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Coordinator", "ProcessSetState"]

_log_ = _log.get_logger()

# Status bits of the fast-path vector, stored inverted (set = condition false), as Horovod.
# _NOT_RETUNE: cleared by global rank 0 when autotune has new parameters to broadcast.
_NOT_SHUTDOWN, _NOT_UNCACHED, _NOT_INVALID, _NOT_RETUNE = 1, 2, 4, 8
_ALL_CLEAR = _NOT_SHUTDOWN | _NOT_UNCACHED | _NOT_INVALID | _NOT_RETUNE
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
_HELD = (RequestType.ALLREDUCE, RequestType.REDUCESCATTER)
# A host op with a new output this large runs on the coordinator thread, not a driving caller.
_DRIVE_ALLOC_LIMIT = 64 * 1024
# Enum members read once (a class attribute read of an enum is slow, and this is per op).
_HIT = CacheState.HIT
_R_ERROR, _R_JOIN, _R_BARRIER = ResponseType.ERROR, ResponseType.JOIN, ResponseType.BARRIER
_R_ALLREDUCE, _R_ADASUM, _R_ALLGATHER = (ResponseType.ALLREDUCE, ResponseType.ADASUM,
                                         ResponseType.ALLGATHER)
_R_BROADCAST, _R_ALLTOALL, _R_REDUCESCATTER = (ResponseType.BROADCAST, ResponseType.ALLTOALL,
                                               ResponseType.REDUCESCATTER)


class ProcessSetState:
    """One process set as this rank sees it. Fields marked (lock) are shared with user threads."""

    def __init__(self, ps_id: int, ranks: list[int], control: Any, host_engine: Any,
                 config: Any, is_global_root: bool) -> None:
        self.id = ps_id
        self.ranks = ranks
        self.control = control
        self.rank = control.rank
        self.size = control.size
        self.is_root = control.rank == 0
        self.host_engine = host_engine
        self.device_engine: Any = None  # created on the first device response (collectively)
        self.config = config
        self.lock = threading.Lock()
        self.table: dict[str, Entry] = {}  # (lock) pending entries by name
        self.queue: list[Request] = []  # (lock) requests not yet negotiated
        # coordinator thread only:
        self.cache = ResponseCache(config.cache_capacity)
        self.hits = PendingHits()  # cached requests waiting for the other ranks
        self.carry: list[Request] = []  # requests that lost their cache entry; sent next cycle
        self.join_active = False  # some rank of the set has joined (cache suspended)
        self.messages = MessageTable(self.size, ranks) if self.is_root else None
        self.stall = StallInspector(config.stall_check_time, config.stall_shutdown_time,
                                    not config.stall_check_disable,
                                    warn=_log_.warning) if self.is_root else None
        self.is_global_root = is_global_root

    def pending(self) -> bool:
        return bool(self.table)

    def pop(self, name: str) -> Entry | None:
        with self.lock:
            return self.table.pop(name, None)

    def drain(self) -> list[Request]:
        with self.lock:
            q, self.queue = self.queue, []
        return q

    def fail_all(self, exc: BaseException) -> None:
        with self.lock:
            entries, self.table, self.queue = list(self.table.values()), {}, []
        for e in entries:
            e.handle._set_exception(exc)
        release_ready(entries)


class Coordinator:
    """Owns the background thread. `run_cycle()` is one step, testable without the thread."""

    def __init__(self, runtime: "Runtime") -> None:
        self.rt = runtime
        self.config = runtime.config
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.shutdown_requested = False  # set by user threads; read each cycle
        self.stopped = threading.Event()
        self.timeline: Any = None  # collective.timeline.Timeline on global rank 0
        self._idle_cycles = 0
        self._warned_eviction = False
        # Device fusion window (see _device_hold): threads blocked on a device op's handle,
        # when the queued device requests started collecting, and a scan cursor per queue.
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._hold_since: float | None = None
        self._scanned: dict[int, tuple[Any, int, int]] = {}  # ps id -> (queue, len, bytes)
        # Cycles may also run on a user thread that is about to block on its op (`drive`):
        # one cycle at a time, under this lock; what such a cycle raises or decides (shutdown)
        # is handed to the coordinator thread, whose loop ends the job as usual.
        self._cycle_lock = threading.Lock()
        self._handoff: BaseException | None = None
        self._ended_by_driver = False
        # Express rounds run (diagnostics: benchmarks and tests read them), and how many of
        # them did not agree on the op, which then waited as an ordinary cache hit.
        self.express_rounds = 0
        self.express_waits = 0
        self._express_ok = False  # set by start()
        self._thread_id: int | None = None
        # Autotuned parameters: every rank switches at the same negotiation round (_retune).
        self.fusion_threshold = self.config.fusion_threshold
        self.cycle_time = self.config.cycle_time
        self.tuner: autotune.Driver | None = None  # global rank 0 while autotune runs
        self.rounds = 0  # negotiation rounds of the global set
        self.retunes: list[tuple[int, autotune.Params]] = []  # (round, parameters applied)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        rt = self.rt
        # What the express lane needs that cannot change while the job runs: the response
        # cache, and one fixed process set (its round covers one set).
        self._express_ok = (not rt.dynamic_process_sets and len(rt.member_sets()) == 1
                            and all(ps.cache.capacity > 0 for ps in rt.member_sets()))
        if self.config.autotune and rt.rank == 0:
            self.tuner = autotune.from_config(self.config)
        self._thread = threading.Thread(target=self._loop, name="hvd-coordinator", daemon=True)
        self._thread.start()
        self._thread_id = self._thread.ident

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
        nccl = sys.modules.get("collective.engines.nccl")
        if any(_left_to_coordinator(ps, nccl is not None) for ps in self.rt.member_sets()):
            self._wake.set()
            return
        if self._cycle_lock.acquire(blocking=False):
            self._guest(self.run_cycle, nccl)
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
                or (self.timeline is not None and ps.is_global_root)
                or self._thread_id == threading.get_ident() or self.stopped.is_set()):
            return False
        req = entry.request
        nccl = sys.modules.get("collective.engines.nccl")
        if (_coordinator_only(req, entry.output is None, nccl is not None)
                or not self._cycle_lock.acquire(False)):
            return False
        try:
            go = (self._handoff is None and not self._ended_by_driver and not ps.queue
                  and not ps.hits and not ps.carry
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
        self._guest(self._express_round, nccl, ps, req, bit)
        return True

    def _express_round(self, ps: ProcessSetState, req: Request, bit: int) -> bool:
        words = np.zeros(1 + (ps.cache.num_bits + 63) // 64, dtype=np.uint64)
        words[0] = _ALL_CLEAR if self.tuner is None or not self.tuner.pending else (
            _ALL_CLEAR ^ _NOT_RETUNE)
        self.rounds += 1
        word = 1 + bit // 64
        words[word] = 1 << (bit % 64)
        res = ps.control.allreduce_words(words, "and")
        agreed = res.tolist()  # numpy scalars are slow; a few Python ints
        self.express_rounds += 1
        if agreed[0] == _ALL_CLEAR and agreed[word] >> (bit % 64) & 1:
            self._perform(ps, ps.cache.get(bit))
            self._idle_cycles = 0
            return True
        self.express_waits += 1
        # Not agreed in this round: the entry waits as a cache hit, and the round ends as any.
        ps.hits.add(bit, req, time.monotonic())
        responses, shutdown = self._conclude(ps, res, [], set(), False)
        for resp in responses:
            self._perform(ps, resp)
        return not shutdown

    def _guest(self, cycle: Any, nccl: Any, *args: Any) -> None:
        """Runs `cycle(*args)` (a cycle's work; False = the job shuts down) on a user thread
        that holds `_cycle_lock` (released here). See `drive` for what happens to its
        outcome."""
        interrupt: BaseException | None = None
        try:
            if self._handoff is None and not self._ended_by_driver:
                # A device engine may make its GPU and stream current on the thread it runs
                # on: the thread gets its own back afterwards.
                if nccl is not None:
                    nccl.guest_enter()
                try:
                    if not cycle(*args):
                        self._ended_by_driver = True
                except BaseException as exc:  # noqa: BLE001 - the loop ends the job
                    self._handoff = exc
                    if not isinstance(exc, Exception):
                        interrupt = exc
                finally:
                    if nccl is not None:
                        nccl.guest_exit()
        finally:
            self._cycle_lock.release()
        if (self._handoff is not None or self._ended_by_driver
                or any(ps.pending() for ps in self.rt.member_sets())):
            self._wake.set()
        if interrupt is not None:
            raise interrupt

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
        window = self.cycle_time
        bucket = min(self.fusion_threshold, _DEVICE_BUCKET)
        sets = self.rt.member_sets()
        if (window <= 0 or bucket <= 0 or self._waiters > 0 or self.shutdown_requested
                or not any(ps.queue for ps in sets)):  # a list's truth needs no lock
            self._hold_since = None
            return 0.0
        total = 0
        for ps in sets:
            with ps.lock:
                q = ps.queue
                old, seen, nbytes = self._scanned.get(ps.id, (None, 0, 0))
                if old is not q or seen > len(q):
                    seen, nbytes = 0, 0
                for req in q[seen:]:
                    rbytes = req.num_elements() * req.dtype.itemsize
                    # Host work, other op types and already-bucketed gradients go at once.
                    if (req.device == CPU_DEVICE or req.type not in _HELD
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
        self.rt._pin_thread()
        cause: BaseException | None = None
        try:
            timed_out = True  # the first cycle always runs
            while True:
                cycle = self.cycle_time
                start = time.monotonic()
                self._wake.clear()
                if self._handoff is not None or self._ended_by_driver:
                    with self._cycle_lock:
                        if self._handoff is not None:  # a cycle on a user thread failed
                            raise self._handoff
                        break  # a cycle on a user thread agreed to shut down
                hold = self._device_hold()
                if hold > 0:
                    self._wake.wait(hold)
                    continue
                with self._cycle_lock:
                    if self._handoff is not None:  # a cycle on a user thread failed
                        raise self._handoff
                    if self._ended_by_driver:
                        break
                    # Woken with nothing to do (a waiting thread already drove the cycle):
                    # an empty negotiation round would only make the peers wait for it.
                    if (timed_out or self._has_work()) and not self.run_cycle():
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
        finally:
            self.rt._on_loop_exit(cause)
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
        now = time.monotonic()
        new = ps.drain()
        tl = self.timeline if ps.is_global_root else None
        cache_on = ps.cache.capacity > 0 and not ps.join_active
        uncached: list[Request] = ps.carry
        ps.carry = []
        invalid: set[int] = set()
        hits = ps.hits
        if not cache_on and hits:  # cache suspended by a join: re-route waiting hits
            uncached.extend(hits.drain())
        for req in new:
            if req.type in (RequestType.JOIN, RequestType.BARRIER) or not cache_on:
                uncached.append(req)
                continue
            state, bit = ps.cache.lookup(req)
            if state is CacheState.HIT:
                hits.add(bit, req, now)
                if tl is not None:
                    tl.negotiate_start(req.name, req.type.name)
            else:
                if state is CacheState.INVALID:
                    invalid.add(bit)
                uncached.append(req)
        limit = self.config.stall_check_time
        if hits and not self.config.stall_check_disable and limit > 0:
            # Hits waiting for other ranks go to the slow path, where rank 0's stall inspector
            # sees them, after a tenth of the warning time (at most 1 s): the warning then comes
            # at most that much after the setting.
            for bit in hits.older_than(now - min(limit / 10, 1.0)):
                uncached.append(hits.pop(bit))
                invalid.add(bit)
        if ps.is_root and self._check_stall(ps):
            self.shutdown_requested = True  # travels with the next global negotiation
        want_shutdown = self.shutdown_requested and ps.id == 0
        words = hits.vector(ps.cache.num_bits if cache_on else 0)
        status = 0
        if not want_shutdown:
            status |= _NOT_SHUTDOWN
        if not uncached:
            status |= _NOT_UNCACHED
        if not invalid:
            status |= _NOT_INVALID
        if ps.id == 0:
            self.rounds += 1
            if self.tuner is None or not self.tuner.pending:
                status |= _NOT_RETUNE
        else:
            status |= _NOT_RETUNE
        words[0] = status
        res = ps.control.allreduce_words(words, "and")
        return self._conclude(ps, res, uncached, invalid, want_shutdown)

    def _conclude(self, ps: ProcessSetState, res: np.ndarray, uncached: list[Request],
                  invalid: set[int], want_shutdown: bool) -> tuple[list[Response], bool]:
        """The rest of a negotiation round once the AND of the status words (`res`) is known:
        the agreed cache hits, and the slow path if any rank sent uncached requests."""
        hits = ps.hits
        tl = self.timeline if ps.is_global_root else None
        flags = int(res[0])
        any_shutdown = not flags & _NOT_SHUTDOWN
        any_uncached = not flags & _NOT_UNCACHED
        if not flags & _NOT_INVALID:
            inv = np.zeros_like(res)
            for bit in invalid:
                inv[1 + bit // 64] |= np.uint64(1 << (bit % 64))
            inv = ps.control.allreduce_words(inv, "or")
            for bit in _bits(inv):
                ps.cache.erase(bit)
                if bit in hits:
                    uncached.append(hits.pop(bit))
        if not flags & _NOT_RETUNE:  # autotune: every rank switches before this round's plan
            self._retune(ps)
        common = hits.take_common(res)
        if tl is not None:
            for b in common:
                tl.negotiate_end(ps.cache.name_of(b))
        threshold = self.fusion_threshold
        if not any_uncached:
            cached = [ps.cache.get(b) for b in common]
            return self._fuse(ps, cached, threshold), any_shutdown
        return self._slow_path(ps, uncached, common, want_shutdown, any_shutdown, threshold)

    def _slow_path(self, ps: ProcessSetState, uncached: list[Request], common: list[int],
                   want_shutdown: bool, any_shutdown: bool,
                   threshold: int) -> tuple[list[Response], bool]:
        gathered = ps.control.gather(encode_requests(uncached, want_shutdown))
        payload = None
        if ps.is_root:
            assert gathered is not None and ps.messages is not None
            lists = decode_gathered(gathered, ps.ranks)
            tl = self.timeline if ps.is_global_root else None
            constructed = ps.messages.process(
                lists,
                on_first=(lambda n, t: tl.negotiate_start(n, t.name)) if tl else None,
                on_rank=(lambda n, r: tl.negotiate_rank_ready(n, r)) if tl else None)
            if tl is not None:
                for r in constructed:
                    for n in r.names:
                        tl.negotiate_end(n)
            responses = [ps.cache.peek(b) for b in common] + constructed
            fused = self._fuse(ps, responses, threshold)
            # Keep the cache suspended through the cycle that completes a join: its responses
            # ran with zeros on joined ranks, which have no entries to cache.
            join_flag = ps.messages.join_active or any(
                r.type == ResponseType.JOIN for r in constructed)
            payload = encode_responses(fused, any_shutdown, join_flag)
        fused, shutdown, join_active = decode_responses(ps.control.bcast(payload))
        ps.join_active = join_active
        if ps.cache.capacity > 0 and not join_active:
            for resp in fused:
                if resp.type not in CACHEABLE:
                    continue
                for single in resp.split():
                    entry = ps.table.get(single.names[0])
                    if entry is not None and ps.cache.put(single, entry.request) and (
                            not self._warned_eviction):
                        self._warned_eviction = True
                        _log_.warning(EVICTION_WARNING)
            ps.cache.renumber()
            ps.carry.extend(ps.hits.remap(ps.cache))  # bit numbers changed
        return fused, shutdown

    def _retune(self, ps: ProcessSetState) -> None:
        """Global rank 0's autotune parameters, broadcast and applied on every rank."""
        data = ps.control.bcast(self.tuner.publish() if self.tuner is not None else None)
        p = autotune.Params.decode(data)
        self.fusion_threshold = p.fusion_threshold
        self.cycle_time = max(p.cycle_time_ms, 0.0) / 1000.0
        self.retunes.append((self.rounds, p))
        if not p.active:
            self.tuner = None  # tuning ended: these values stay
        _log.trace("autotune: round %d: fusion threshold %d, cycle time %g ms", self.rounds,
                   p.fusion_threshold, p.cycle_time_ms)

    def _fuse(self, ps: ProcessSetState, responses: list[Response],
              threshold: int) -> list[Response]:
        if len(responses) <= 1:
            return responses
        return plan_fusion(responses, threshold, ps.size,
                           disable_group_fusion=self.config.disable_group_fusion)

    def _check_stall(self, ps: ProcessSetState) -> bool:
        if ps.stall is None or not ps.stall.due() or ps.messages is None:
            return False
        report, stop = ps.stall.check(ps.messages.pending(), ps.size, ps.ranks,
                                      ps.messages.joined)
        if report:
            (_log_.error if stop else _log_.warning)(report)
        return stop

    # -- execution ----------------------------------------------------------------------------
    def _perform(self, ps: ProcessSetState, resp: Response) -> None:
        tl = self.timeline if ps.is_global_root else None
        t = resp.type
        if t == _R_ERROR:
            exc = MismatchError(resp.error)
            failed = []
            for name in resp.names:
                e = ps.pop(name)
                if tl is not None:
                    tl.end_error(name)
                if e is not None:
                    e.handle._set_exception(exc)
                    failed.append(e)
            release_ready(failed)
            return
        if t == _R_JOIN or t == _R_BARRIER:
            e = ps.pop(resp.names[0])
            if e is not None:
                e.handle._set_result(resp.last_joined_rank if t == _R_JOIN else None)
            return
        entries: list[Entry] = []
        device = resp.device
        engine = self._engine(ps, device)
        with ps.lock:
            popped = [ps.table.pop(name, None) for name in resp.names]
        for i, name in enumerate(resp.names):
            e = popped[i]
            if e is None:  # this rank joined: contribute zeros of the agreed size
                shape = resp.shapes[i] if resp.shapes else (resp.sizes[i],)
                z = engine.zeros(shape, resp.dtype, device)
                e = Entry(Request(rank=ps.rank, type=RequestType(int(resp.type)), name=name,
                                  dtype=resp.dtype, shape=shape, device=device),
                          z, Handle(name), output=z)
            entries.append(e)
            if tl is not None:
                tl.start(name, resp.type.name)
        try:
            if t == _R_ALLREDUCE or t == _R_ADASUM:
                engine.allreduce(entries, resp)
                if self.tuner is not None and t == _R_ALLREDUCE and ps.id == 0:
                    self.tuner.record(resp.names, sum(resp.sizes) * resp.dtype.itemsize)
            elif t == _R_ALLGATHER:
                engine.allgather(entries, resp)
            elif t == _R_BROADCAST:
                engine.broadcast(entries[0], ps.ranks.index(resp.root))
            elif t == _R_ALLTOALL:
                engine.alltoall(entries[0])
            elif t == _R_REDUCESCATTER:
                engine.reducescatter(entries, resp)
            else:  # pragma: no cover - negotiation never produces other types
                raise HorovodInternalError(f"unexpected response type {t.name} for {resp.names}")
            for e in entries:
                if tl is not None:
                    out = e.output
                    tl.end(e.name, resp.dtype.label, tuple(getattr(out, "shape", ())))
                e.handle._set_result(engine.finish(e))
        except BaseException as exc:
            # These entries already left the table, so the loop's exit path (fail_all) cannot
            # reach them: fail them here or their waiters hang forever.
            err = shutdown_error(exc)
            for e in entries:
                if tl is not None:
                    tl.end_error(e.name)
                e.handle._set_exception(err)
            raise

    def _engine(self, ps: ProcessSetState, device: int) -> Any:
        if device == CPU_DEVICE:
            return ps.host_engine
        if ps.device_engine is None:
            ps.device_engine = create_engine(self.rt.device_engine_name, ps.control, self.config)
            ps.device_engine.timeline = ps.host_engine.timeline
        return ps.device_engine


def _left_to_coordinator(ps: ProcessSetState, gpu_bound: bool) -> bool:
    """Whether some queued op must run on the coordinator thread (`_coordinator_only`)."""
    for r in ps.queue:
        e = ps.table.get(r.name)  # a dict read needs no lock
        if _coordinator_only(r, e is None or e.output is None, gpu_bound):
            return True
    return False


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


def _bits(words: np.ndarray) -> list[int]:
    out = []
    for i, w in enumerate(words[1:].tolist()):
        while w:
            low = w & -w
            out.append(i * 64 + low.bit_length() - 1)
            w ^= low
    return out


def shutdown_error(cause: BaseException | None) -> BaseException:
    if isinstance(cause, HorovodInternalError):
        return cause
    err = ShutdownError()
    err.__cause__ = cause
    return err
