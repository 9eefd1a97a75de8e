"""`Runtime`: the object `init()` creates; it owns config, control planes, engines, process sets
and the coordinator. Module-level functions look it up in `collective._current`.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import threading
import warnings
from typing import Any, Sequence

from . import _current, _log
from .agreement import agree, change_of, common_set, ranks_here
from .config import Config, read_env
from .coordinator import HELD, Coordinator, ProcessSetState, shutdown_error
from .engines import create_backend, create_engine
from .entry import Entry
from .errors import DuplicateNameError
from .handle import Handle
from .process_sets import ProcessSet, global_process_set
from .wire import MAX_STR_BYTES, WireError

__all__ = ["Runtime", "detect_mode"]

_log_ = _log.get_logger()


def detect_mode(config: Config, comm: Any = None) -> str:
    """Picks the backend: explicit controller, launcher variables, MPI launchers, torchrun, else
    a single process.

    Raises:
        ValueError: HOROVOD_CONTROLLER asks for tcp mode in an MPI job of several ranks that
            carries no tcp rendezvous (each rank would be a world of its own).
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        if config.controller != "tcp" and not config.rendezvous_addr:
            return "mpi"
        # A tcp launch (hvdrun --tcp / --gloo): its world is every rank the launcher started,
        # as in Horovod, whose Gloo controller ignores the communicator. Over MPI each rank
        # would be a world of its own here (no mpirun), training unsynchronised.
        warnings.warn("hvd.init(comm=<mpi4py communicator>) has no effect in tcp mode (this "
                      "job was launched with hvdrun --tcp or HOROVOD_CONTROLLER=gloo): the "
                      "world is every rank the launcher started; launch with hvdrun --mpi or "
                      "mpirun for the communicator to define it", RuntimeWarning, stacklevel=2)
    ctl = config.controller or config.cpu_operations  # "mpi", "tcp" or "" (config checks)
    if ctl == "mpi":
        return "mpi"
    if ctl == "tcp":
        mpi_world = (config.ompi_size > 1 or config.pmi_size > 1
                     or (config.pmix_rank >= 0 and config.slurm_ntasks > 1))
        rendezvous = config.rendezvous_addr or (config.env_world_size > 0
                                                and config.master_addr)
        if not mpi_world or rendezvous:
            return "tcp"
        if config.controller:
            raise ValueError(
                "HOROVOD_CONTROLLER=gloo/tcp in an MPI job: ringvod's tcp mode forms its world "
                "through hvdrun's rendezvous (hvdrun --tcp sets HOROVOD_GLOO_RENDEZVOUS_ADDR/"
                "PORT, HOROVOD_RANK, HOROVOD_SIZE) or torchrun-style variables, not through MPI; "
                "launch with hvdrun --tcp, or unset HOROVOD_CONTROLLER to run over MPI")
        # HOROVOD_CPU_OPERATIONS alone does not pick the controller (as in Horovod): the MPI
        # job runs in MPI mode, and init() warns that the host ops stay on MPI.
    if config.rendezvous_addr:
        return "tcp"
    if comm is not None or config.ompi_size > 0 or config.pmi_size > 0 or config.pmix_rank >= 0:
        return "mpi"
    if config.env_world_size > 0 and config.master_addr:
        return "tcp"
    return "single"


class Runtime:
    def __init__(self, config: Config, control: Any, mode: str,
                 process_sets: Sequence[ProcessSet] | str | None = None,
                 host_engine: str | None = None, device_engine: str = "nccl") -> None:
        self.config = config
        self.mode = mode
        self.control = control  # the world's control plane
        self.rank, self.size = control.rank, control.size
        self.host_engine_name = host_engine or {"single": "loopback"}.get(mode, mode)
        self.device_engine_name = device_engine
        self._handle_ids = itertools.count()
        self._lock = threading.Lock()  # guards _sets/_registry/_members/_ps_changes/state
        self._sets: dict[int, ProcessSetState] = {}
        self._registry: dict[int, ProcessSet] = {}
        self._members: list[ProcessSetState] = []
        self._ps_changes: list[tuple[str, Any, Handle]] = []
        # The message of the change at the head of the queue, worked out once (a rank may wait
        # many cycles for the others): (its handle, the message).
        self._head_msg: tuple[Handle, list] | None = None
        self.shut_down = False
        self.cause: BaseException | None = None
        # Global ranks that asked for the clean shutdown, and why (`shutdown_error`)
        self.shut_down_by: dict[int, str] = {}
        try:
            self._topology()
            _log.configure(config.log_level, config.log_hide_time, self.rank,
                           self.hostname if self.cross_size > 1 else None)
            if process_sets == "dynamic":
                config = config.replace(dynamic_process_sets=True)
            self.config, static = agree(control, config, process_sets)
            self.dynamic_process_sets = self.config.dynamic_process_sets
            self.coordinator = Coordinator(self)
            self._register(0, list(range(self.size)), control, global_process_set)
            if isinstance(process_sets, (list, tuple)):
                for ps, (sets, own) in zip(process_sets, static):
                    self._add_placed(ps, sets, own)
            self._setup_timeline()
        except BaseException:
            # A step after the ranks connected failed (different process sets, a duplicate
            # set, the timeline's file): nothing of this world may outlive the error.
            self._release()
            raise

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, comm: Any = None, process_sets: Any = None, config: Config | None = None,
               control: Any = None, mode: str | None = None, **kw: Any) -> "Runtime":
        config = config or read_env()
        # HOROVOD_LOG_LEVEL/_HIDE_TIME apply to what forming the world logs too (the rank
        # prefix is the launcher's until the world says otherwise).
        _log.configure(config.log_level, config.log_hide_time,
                       config.rank if config.rank >= 0 else None)
        if control is None:
            mode = mode or detect_mode(config, comm)
            extra: dict[str, Any] = {}
            if config.elastic and mode == "tcp":  # the elastic driver assigns rank and size
                from .elastic import rendezvous  # noqa: PLC0415
                config, extra["scope"] = rendezvous(config)
            control = create_backend(mode, config, comm=comm, **extra)
        return cls(config, control, mode or "loopback", process_sets, **kw)

    def _topology(self) -> None:
        c = self.config
        self.hostname = c.hostname or socket.gethostname()
        hosts = [_host_of(b, r) for r, b in
                 enumerate(self.control.allgather(self.hostname.encode("utf-8")))]
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        same = [r for r, h in enumerate(hosts) if h == self.hostname]
        self.local_rank, self.local_size = same.index(self.rank), len(same)
        local_of = [sum(1 for q in range(r) if hosts[q] == hosts[r]) for r in range(self.size)]
        with_my_local = [order.index(hosts[r]) for r in range(self.size)
                         if local_of[r] == self.local_rank]
        self.cross_rank = sorted(with_my_local).index(order.index(self.hostname))
        self.cross_size = len(with_my_local)
        self.is_homogeneous = len({hosts.count(h) for h in order}) == 1

    def _register(self, ps_id: int, ranks: list[int], control: Any, ps: ProcessSet) -> None:
        if ps is not global_process_set:
            ps._bind(ps_id, ranks, self)
        self._registry[ps_id] = ps
        if control is None:
            return
        engine = create_engine(self.host_engine_name, control, self.config)
        state = ProcessSetState(ps_id, ranks, control, engine, self.config)
        # Global rank 0 draws the ops of every set it belongs to, as Horovod's controllers share
        # its one timeline (a set added after init() finds the timeline already there).
        tl = self.coordinator.timeline
        if tl is not None:
            state.timeline = engine.timeline = tl.for_set(ps_id)
        self._sets[ps_id] = state
        self._members = [self._sets[k] for k in sorted(self._sets)]

    def _add_static(self, ps: ProcessSet, ranks: list[int]) -> None:
        """Registers `ps` with the ranks every rank agreed on (init's sets, add_process_set).

        Raises:
            ValueError: no ranks, a duplicate, or ranks out of range (every rank alike).
        """
        if not ranks:
            raise ValueError(f"process set {ps} has no ranks: every rank passed MPI.COMM_NULL "
                             "or an empty set (the global process set is always there; leave "
                             "it out)")
        for other in self._registry.values():
            if other is not global_process_set and other.ranks == ranks:
                raise ValueError(f"Attempted to add a duplicate process set: {ps}")
        if any(r < 0 or r >= self.size for r in ranks):
            raise ValueError(f"process set ranks {ranks} out of range for size {self.size}")
        control = self.control.split(ranks)
        try:
            self._register(self._next_ps_id(), ranks, control, ps)
        except BaseException:
            if control is not None and all(m.control is not control for m in self._members):
                control.close()
            raise

    def _add_placed(self, ps: ProcessSet, sets: list[list[int]], own: list[int] | None) -> None:
        """Registers the sets init() agreed on for one place of its list (`agreement.agree`):
        one, or one per communicator of a split. `ps` becomes the one with ranks `own` (None:
        this rank is outside every communicator of the split, and `ps` stays unregistered);
        the others get `ProcessSet` objects of their own.

        Raises:
            ValueError: as `_add_static` (every rank alike).
        """
        if not sets:
            self._add_static(ps, [])  # raises: no ranks
        for ranks in sets:
            self._add_static(ps if ranks == own else ProcessSet(ranks), ranks)

    def _next_ps_id(self) -> int:
        i = 1
        while i in self._registry:
            i += 1
        return i

    def _setup_timeline(self) -> None:
        path = self.config.timeline
        self.timeline_enabled = bool(path)
        if not path or self.rank != 0:
            return
        from .timeline import Timeline  # written off the critical path by its own thread
        dynamic = path.upper() == "DYNAMIC"
        # Closed by this runtime's shutdown, at exit too (`_atexit_shutdown`), after the last
        # cycles' events.
        tl = Timeline("" if dynamic else path, self.config.timeline_mark_cycles,
                      close_at_exit=False)
        self.coordinator.timeline = tl
        for ps in self._members:
            ps.timeline = ps.host_engine.timeline = tl.for_set(ps.id)

    def start(self) -> "Runtime":
        self.coordinator.start()
        return self

    def abandon(self, reason: str) -> None:
        """Undoes an `init()` that failed on this rank after the runtime was made (its start,
        or a later step): stops the coordinator if it runs (aborting the control planes
        first) and releases what `_release` does. Later submits raise `ShutdownError`."""
        with self._lock:
            self.shut_down = True
        coord = self.coordinator
        if not coord.join(0):
            for ps in self._members:
                ps.control.abort(reason)
            coord.request_shutdown()
            if not coord.join(5.0):
                _log_.error("the coordinator did not stop within 5 s of a failed init()")
        self._release()

    def _pin_thread(self) -> None:
        spec = self.config.thread_affinity
        if not spec:
            return
        cores = [int(c) for c in spec.split(",") if c.strip()]
        if cores and hasattr(os, "sched_setaffinity"):
            core = cores[self.local_rank % len(cores)]
            try:
                os.sched_setaffinity(0, {core})
            except OSError as exc:  # Horovod logs it and runs unpinned
                _log_.error("HOROVOD_THREAD_AFFINITY=%s: cannot pin the coordinator thread of "
                            "local rank %d to core %d (%s); it runs unpinned", spec,
                            self.local_rank, core, exc)

    # -- process sets -------------------------------------------------------------------------
    def member_sets(self) -> list[ProcessSetState]:
        return self._members

    def process_set_state(self, ps: ProcessSet, op_label: str) -> ProcessSetState:
        """Resolves a user ProcessSet to this rank's state.

        Raises:
            ValueError: unknown set, or this rank is not a member (Horovod's texts).
        """
        ps_id = 0 if ps is global_process_set or ps is None else ps.process_set_id
        if ps_id is None or ps_id not in self._registry:
            raise ValueError(f"{op_label}: Process set provided does not exist, or has not "
                             "been registered.")
        state = self._sets.get(ps_id)
        if state is None:
            raise ValueError(f"{op_label}: Rank {self.rank} is not a member of the provided "
                             "process set.")
        return state

    def registered_set(self, ps_id: int) -> ProcessSet:
        """The registered process set with id `ps_id` (Horovod's graph ops name sets by id).

        Raises:
            ValueError: no set has that id (Horovod's text).
        """
        with self._lock:
            ps = self._registry.get(ps_id)
        if ps is None:
            raise ValueError(f"Process set with id {ps_id}: Process set provided does not "
                             "exist, or has not been registered.")
        return ps

    def ranks_of(self, ps: ProcessSet) -> list[int]:
        if ps is global_process_set or ps is None:
            return list(range(self.size))
        return list(ps.ranks or [])

    def request_process_set_change(self, kind: str, arg: Any) -> Handle:
        if not self.dynamic_process_sets:
            verb = "adding" if kind == "add" else "removing"
            raise ValueError(f"Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow {verb} process sets "
                             "after Horovod initialization.")
        h = Handle(f"process_set.{kind}")
        with self._lock:
            self._check_running()
            self._ps_changes.append((kind, arg, h))
        self.coordinator.wake()
        return h

    def has_changes(self) -> bool:
        return bool(self._ps_changes)

    def _sync_process_set_changes(self) -> None:
        """Coordinator thread, every cycle in dynamic mode: apply changes all ranks agree on."""
        with self._lock:
            head = self._ps_changes[0] if self._ps_changes else None
        mine = None
        if head is not None:
            if self._head_msg is None or self._head_msg[0] is not head[2]:
                self._head_msg = (head[2], ["add", ranks_here(head[1], self.control)]
                                  if head[0] == "add" else ["remove", int(head[1])])
            mine = self._head_msg[1]
        views = [change_of(b, r)
                 for r, b in enumerate(self.control.allgather(json.dumps(mine).encode()))]
        if any(v is None for v in views):
            return
        with self._lock:
            self._ps_changes.pop(0)
        assert head is not None
        kind, arg, handle = head
        added = common_set([v[1] for v in views]) if all(v[0] == "add" for v in views) else None
        if added is None and any(v != views[0] for v in views):
            by: dict[str, list[int]] = {}
            for r, v in enumerate(views):
                what = (f"add_process_set({v[1]})" if v[0] == "add"
                        else f"remove_process_set(<process set {v[1]}>)")
                by.setdefault(what, []).append(r)
            handle._set_exception(ValueError(
                "process set changes differ across ranks: " + "; ".join(
                    f"rank(s) {', '.join(map(str, rs))} called {w}" for w, rs in by.items())
                + ". Every rank must make the same add_process_set/remove_process_set calls "
                "in the same order"))
            return
        try:
            if kind == "add":
                self._add_static(arg, added)
                handle._set_result(arg)
            else:
                handle._set_result(self._remove(arg))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            handle._set_exception(exc)

    def _remove(self, ps_id: int) -> bool:
        ps = self._registry.pop(ps_id, None)
        if ps is None:
            return False
        state = self._sets.pop(ps_id, None)
        self._members = [self._sets[k] for k in sorted(self._sets)]
        if state is not None:
            with state.lock:  # a submit that resolved the set before this now refuses it
                names = sorted(state.table)
                state.removed = True
            shown = ", ".join(repr(n) for n in names[:5]) + (
                f" and {len(names) - 5} more" if len(names) > 5 else "")
            if not names:
                shown = "its gradient sets' ops"
            state.fail_all(ValueError(
                f"process set {ps_id} (ranks {state.ranks}) was removed by remove_process_set() "
                f"while {shown} waited on rank {self.rank}; wait for a set's ops (synchronize) "
                "before removing it"))
            state.host_engine.close()
            if state.device_engine is not None:  # its GPU work drains, its communicator goes
                state.device_engine.close()
            state.control.close()
        ps._invalidate()
        return True

    # -- submission ---------------------------------------------------------------------------
    def next_handle_id(self) -> int:
        return next(self._handle_ids)

    def _check_running(self) -> None:
        if self.shut_down:
            raise shutdown_error(self.cause, self.shut_down_by)

    def submit(self, state: ProcessSetState, entries: list[Entry], wake: bool = True) -> None:
        """Queues entries atomically (a grouped op negotiates as one). `wake=False`: the caller
        runs the cycle itself (`Coordinator.drive`).

        Raises:
            DuplicateNameError: a name is already pending on this rank.
            ShutdownError: the runtime has shut down.
        """
        self._check_running()
        with state.lock:
            if state.removed:  # removed on the coordinator thread since the caller looked
                raise ValueError(
                    f"Process set provided does not exist, or has not been registered: process "
                    f"set {state.id} (ranks {state.ranks}) was removed by remove_process_set() "
                    f"while {entries[0].name!r} was being submitted on rank {self.rank}; "
                    "synchronize a set's ops and stop submitting to it before removing it")
            for i, e in enumerate(entries):
                if e.name in state.table or any(e.name == o.name for o in entries[:i]):
                    raise DuplicateNameError(
                        f"Requested to collective {e.name!r}, but a tensor with the same name is "
                        f"already pending on rank {self.rank}. Wait for the first op (synchronize"
                        ") or give the tensors distinct names.")
            for e in entries:
                state.table[e.name] = e
                state.queue.append(e.request)
        if self.shut_down:  # raced with the loop's exit: fail what we just queued
            state.fail_all(shutdown_error(self.cause, self.shut_down_by))
        if wake:
            self.coordinator.wake(held=all(e.request.device >= 0 and e.request.type in HELD
                                           for e in entries))

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 60.0) -> None:
        """Stops the coordinator on every rank (the flag travels with the next negotiation)."""
        if not self.coordinator.stopped.is_set():
            self.coordinator.request_shutdown()
            if not self.coordinator.join(timeout):
                _log_.error("the coordinator did not stop within %.0f s; aborting", timeout)
                for ps in self._members:
                    ps.control.abort("shutdown timed out")
                self.coordinator.join(5.0)
        self._release()

    def _release(self) -> None:
        """Closes the engines and control planes of every set (the world's last) and the
        timeline, and unbinds the `ProcessSet` objects registered here: their ids name sets
        of this world only (a later world may give the id to another set), so they read None
        until an `init()` or `add_process_set()` registers them again."""
        try:
            for ps in self._members:
                for eng in (ps.host_engine, ps.device_engine):
                    if eng is not None:
                        eng.close()
                if ps.control is not self.control:
                    ps.control.close()
            self.control.close()
        finally:  # the timeline has no exit hook of its own (`_setup_timeline`)
            coord = getattr(self, "coordinator", None)  # None: construction failed before it
            tl = coord.timeline if coord is not None else None
            if tl is not None:
                tl.close()
        for ps in list(self._registry.values()):
            if ps is not global_process_set and ps._runtime is self:
                ps._invalidate()

    def _on_loop_exit(self, cause: BaseException | None) -> None:
        asked = self.coordinator.negotiator.shutdown_ranks
        with self._lock:
            # This rank's own shutdown needs no naming; its own stall shutdown does.
            self.shut_down_by = {r: why for r, why in asked.items()
                                 if r != self.rank or why == "stall"}
            self.shut_down = True
            self.cause = cause
            changes, self._ps_changes = self._ps_changes, []
        exc = shutdown_error(cause, self.shut_down_by)
        for ps in self._members:
            ps.fail_all(exc)
        for _, _, h in changes:
            h._set_exception(exc)


# -- the plain-data message of the topology exchange (never pickle) ----------------------------
def _host_of(data: bytes, rank: int) -> str:
    if not 0 < len(data) <= MAX_STR_BYTES:
        raise WireError(f"rank {rank} sent a malformed host name ({len(data)} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"rank {rank} sent a malformed host name (not UTF-8: {exc})") from None


def _atexit_shutdown() -> None:
    rt = _current.process_runtime()
    if rt is not None:
        try:
            rt.shutdown(timeout=10.0)
        finally:
            _current.set_current(None)


# threading's hook runs before the interpreter joins threads and before atexit handlers (where
# mpi4py may finalize MPI), so the coordinator still has a working transport when it stops.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_atexit_shutdown)
else:  # pragma: no cover
    atexit.register(_atexit_shutdown)
