"""Horovod's timeline: a Chrome trace-event JSON file of every tensor's life.

The coordinator thread (rank 0 of the global process set) calls the event methods of
`Timeline` for the global set's ops, and of the `SetTimeline` that `Timeline.for_set` gives
for any other set's (its rows carry the set); both classes take them from `_Events`. A call
only reads a clock and puts a tuple on a `queue.SimpleQueue`. A named writer thread
(`hvd-timeline-writer`) drains the queue in batches, runs the per-tensor state machine, formats
the records and writes them with one `os.pwrite` per chunk, so no Python-side buffer holds
data that a crash could lose.

The file it writes, and why a killed job still leaves a readable one, is described in
`collective.timeline.tracefile`.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

from .._log import get_logger
from .tracefile import (_ACT_END, _ACT_START, _C_FLUSH, _C_QUIT, _C_START, _C_STOP, _END,
                        _END_ERROR, _MARK, _NEG_END, _NEG_START, _RANK_READY, _START,
                        FileWriter)

__all__ = ["Timeline", "SetTimeline", "ACTIVITIES", "QUEUE_CAPACITY"]

# Activity names of Horovod's common.h; engines may add their own (any string works).
ACTIVITIES = (
    "INIT_FUSION_BUFFER", "WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA", "ALLOCATE_OUTPUT",
    "MPI_CROSS_ALLGATHER", "MPI_ALLGATHER", "INIT_NCCL", "QUEUE", "MEMCPY_IN_FUSION_BUFFER",
    "MEMCPY_IN_HOST_BUFFER", "MEMCPY_IN_SHARED_BUFFER", "MPI_ALLREDUCE", "MPI_ADASUM_ALLREDUCE",
    "MPI_REDUCESCATTER", "MEMCPY_OUT_HOST_BUFFER", "NCCL_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER",
    "MPI_BCAST", "MPI_ALLTOALL", "NCCL_REDUCESCATTER", "NCCL_ALLGATHER", "NCCL_REDUCE",
    "NCCL_BCAST", "NCCL_ALLTOALL", "COPY_ALLGATHER_OUTPUT", "ALLOCATE_SHARED_BUFFER",
    "CCL_ALLREDUCE", "CCL_ALLGATHER", "CCL_BCAST", "CCL_ALLTOALL", "GLOO_ALLREDUCE",
    "GLOO_ALLGATHER", "GLOO_BCAST", "GLOO_REDUCESCATTER",
)

# Horovod's SPSC queue holds this many records; past it, events are dropped until the writer
# has caught up to half of it (memory stays bounded if the disk stalls).
QUEUE_CAPACITY = 1 << 20

_BATCH = 1024  # events formatted per drain before the GIL is given back by a write
# After a partial batch the writer pauses this long: events pile up meanwhile, so a put rarely
# has to wake the writer (a futex call each time) and the writer takes the GIL in fewer,
# larger slices (measured ~10% less writer CPU per event than 1 ms). It bounds how stale the
# file can be when the job is killed.
_POLL_S = 0.005

_now = time.perf_counter_ns
_log = get_logger()


class _Reply:
    """A command's completion: the writer sets it, the caller waits on it."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, thread: threading.Thread | None) -> None:
        # No overall deadline: a long backlog (up to QUEUE_CAPACITY events) may take seconds,
        # but a dead writer must not hang the caller.
        while not self.done.wait(0.2):
            if thread is None or not thread.is_alive():
                raise RuntimeError("the timeline writer thread (hvd-timeline-writer) has died; "
                                   "see the log above for its error")


class _State:
    """What a `Timeline`'s event methods read, shared with its per-set views."""

    __slots__ = ("on", "live", "mark", "path")

    def __init__(self, mark: bool) -> None:
        self.on = False  # a file is open (the `enabled` property)
        self.live = False  # events are accepted: `on` and the queue is not overfull
        self.mark = bool(mark)
        self.path = ""


class _Events:
    """The event methods (the coordinator's hot path), of a `Timeline` and of its per-set views.

    Each reads the shared `_State` (`_st`), puts on the timeline's queue (`_q`) and adds the
    object's suffix (`_sfx`: "" for the global set, whose names are passed on untouched, be they
    str or not) to every tensor name.
    """

    __slots__ = ()
    _st: _State
    _q: queue.SimpleQueue
    _sfx: str

    @property
    def enabled(self) -> bool:
        """True while a file is being written."""
        return self._st.on

    @property
    def path(self) -> str:
        """The file being written, or "" when stopped."""
        return self._st.path

    @property
    def mark_cycles(self) -> bool:
        return self._st.mark

    def negotiate_start(self, name: str, request_type: Any) -> None:
        """`B NEGOTIATE_<TYPE>` on the tensor's first request (`request_type` 'ALLREDUCE')."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_NEG_START, name + sfx if sfx else name, _now(), request_type))

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        """An `X` event named after the rank whose request for `name` just arrived."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_RANK_READY, name + sfx if sfx else name, _now(), rank))

    def negotiate_end(self, name: str) -> None:
        """`E` closing the negotiation of `name`."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_NEG_END, name + sfx if sfx else name, _now()))

    def start(self, name: str, response_type: Any) -> None:
        """`B <TYPE>` (top level, e.g. 'ALLREDUCE') when the operation on `name` begins."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_START, name + sfx if sfx else name, _now(), response_type))

    def activity_start_all(self, names: Sequence[str], activity: str) -> None:
        """A nested `B <activity>` for every tensor of a (fused) response."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_ACT_START, tuple([n + sfx for n in names]) if sfx else tuple(names),
                         _now(), activity))

    def activity_end_all(self, names: Sequence[str]) -> None:
        """`E` for the current activity of every tensor in `names`."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_ACT_END, tuple([n + sfx for n in names]) if sfx else tuple(names),
                         _now()))

    def activity_start(self, name: str, activity: str) -> None:
        """`activity_start_all` for one tensor."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_ACT_START, (name + sfx if sfx else name,), _now(), activity))

    def activity_end(self, name: str) -> None:
        """`activity_end_all` for one tensor."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_ACT_END, (name + sfx if sfx else name,), _now()))

    def end(self, name: str, dtype: Any, shape: Iterable[int]) -> None:
        """`E` of the top-level span with args dtype ('float32') and shape ('[3, 4]')."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_END, name + sfx if sfx else name, _now(), dtype, shape))

    def end_error(self, name: str) -> None:
        """Closes whatever is open for `name` (the op failed), without args."""
        if self._st.live:
            sfx = self._sfx
            self._q.put((_END_ERROR, name + sfx if sfx else name, _now()))


class Timeline(_Events):
    """Rank 0's timeline; `tracefile` describes the file it writes.

    The event methods may be called from one thread (the coordinator); `start_file`,
    `stop_file`, `flush` and `close` from any thread. Event methods do nothing unless `enabled`.

    Args:
        path: file to write from now on; "" (or "DYNAMIC") to wait for `start_file`.
        mark_cycles: write a `CYCLE_START` instant event on every `mark_cycle()`.
    """

    def __init__(self, path: str, mark_cycles: bool = False, close_at_exit: bool = True) -> None:
        self._st, self._sfx = _State(mark_cycles), ""  # no suffix: Horovod's names
        # False: the owner closes it at exit (the runtime, after its last cycles, whose events
        # a close of its own, run first by the interpreter's exit hooks, would cut off).
        self._close_at_exit = close_at_exit
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set with every command so the writer skips its pause
        self._lock = threading.Lock()  # serialises start/stop/flush/close
        self._thread: threading.Thread | None = None
        self._dropping = False
        self._views: dict[int, SetTimeline] = {}
        if path and path != "DYNAMIC":
            try:
                self.start_file(path, mark_cycles)
            except OSError as exc:
                # Horovod logs and runs on without a timeline rather than failing init().
                _log.error("Error opening the Horovod Timeline file %s, will not write a "
                           "timeline: %s", path, exc)

    # --- per-set views and cycle marks (the other event methods are `_Events`') -----------
    def for_set(self, process_set_id: int) -> "Timeline | SetTimeline":
        """The event methods for the ops of one process set: this timeline itself for the
        global set (id 0), whose rows are named as Horovod names them, else a `SetTimeline`
        whose rows carry the set (`allreduce.x [set 2]`), so that ops of different sets under
        one name (unnamed ops are numbered per set) never share a row."""
        if process_set_id == 0:
            return self
        view = self._views.get(process_set_id)
        if view is None:
            view = self._views[process_set_id] = SetTimeline(self, process_set_id)
        return view

    def mark_cycle(self) -> None:
        """A global instant event `CYCLE_START`, when marking cycles."""
        if self._st.live and self._st.mark:
            self._q.put((_MARK, _now()))

    # --- control ----------------------------------------------------------------------------
    def start_file(self, path: str, mark_cycles: bool) -> None:
        """Starts writing `path` (truncated), or switches to it; blocks until the writer has.

        The same path as the one being written is a no-op (only `mark_cycles` is updated).
        Events queued before the call go to the old file; the new file's timestamps count
        from this call.

        Raises:
            ValueError: `path` is empty, not a str (bytes) or holds a NUL character.
            OSError / other: the file cannot be created; the timeline is then stopped.
            RuntimeError: the writer thread has died.
        """
        path = os.fspath(path)
        if not isinstance(path, str) or not path or "\0" in path:
            raise ValueError(f"start_timeline needs a file path (a non-empty str without NUL "
                             f"characters), e.g. hvd.start_timeline('/tmp/timeline.json'); got "
                             f"{path!r}")
        with self._lock:
            self._st.mark = bool(mark_cycles)
            if self._st.on and path == self._st.path:
                _log.info("Current filename for timeline is same as new filename %s. "
                          "Returning.", path)
                return
            self._ensure_thread()
            reply = _Reply()
            # Both clocks are read together so ts and the epoch anchor agree.
            t0, epoch_us = _now(), time.time_ns() // 1000
            self._q.put((_C_START, reply, path, t0, epoch_us))
            self._wake.set()
            reply.wait(self._thread)
            if reply.error is not None:
                self._st.on = self._st.live = False
                self._st.path = ""
                err = reply.error
                raise OSError(getattr(err, "errno", None),
                              f"cannot write the timeline file {path!r}: {err}; check that its "
                              "directory exists and is writable") from err
            self._st.path, self._st.on, self._st.live, self._dropping = path, True, True, False

    def stop_file(self) -> None:
        """Stops writing; blocks until every queued event is in the file and it is closed.

        Raises:
            RuntimeError: the writer thread has died.
        """
        with self._lock:
            if not self._st.on:
                _log.info("Timeline is already stopped; ignoring the stop request.")
                return
            self._st.on = self._st.live = False
            self._command(_C_STOP)
            self._st.path = ""

    def flush(self) -> None:
        """Blocks until every event queued so far is written (a no-op when stopped).

        Raises:
            RuntimeError: the writer thread has died.
        """
        with self._lock:
            if self._thread is not None:
                self._command(_C_FLUSH)

    def close(self) -> None:
        """Flushes and closes the file and joins the writer thread (idempotent)."""
        with self._lock:
            self._st.on = self._st.live = False
            self._st.path = ""
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                reply = _Reply()
                self._q.put((_C_QUIT, reply))
                self._wake.set()
                try:
                    reply.wait(thread)
                except RuntimeError:
                    pass
                thread.join()

    def _command(self, kind: int) -> None:
        reply = _Reply()
        self._q.put((kind, reply))
        self._wake.set()
        reply.wait(self._thread)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        # The thread holds only a weak reference so an abandoned Timeline can be collected; a
        # daemon thread plus an interpreter-exit hook flushes what was queued at exit.
        self._thread = threading.Thread(target=_writer_main,
                                        args=(weakref.ref(self), self._q, self._wake),
                                        name="hvd-timeline-writer", daemon=True)
        self._thread.start()
        # An abandoned Timeline posts the stop sentinel when collected (the queue outlives it).
        weakref.finalize(self, self._q.put, (_C_QUIT, _Reply()))
        if not self._close_at_exit:
            return
        try:
            ref = weakref.ref(self)
            threading._register_atexit(lambda: (t := ref()) is not None and t.close())
        except (AttributeError, RuntimeError):  # interpreter already shutting down
            pass

    # Called on the writer thread after each batch.
    def _check_backlog(self, q: queue.SimpleQueue) -> None:
        pending = q.qsize()
        if pending > QUEUE_CAPACITY and self._st.live:
            self._st.live = False
            if not self._dropping:
                self._dropping = True
                _log.warning("Timeline writer is more than %d events behind; dropping timeline "
                             "events until it catches up (the file may show unclosed spans).",
                             QUEUE_CAPACITY)
        elif not self._st.live and pending < QUEUE_CAPACITY // 2 and self._st.on:
            if self._lock.acquire(blocking=False):  # start/stop own the flags while they run
                try:
                    if self._st.on:
                        self._st.live = True
                finally:
                    self._lock.release()


class SetTimeline(_Events):
    """`Timeline`'s event methods for a process set other than the global one.

    Every name gets the set's suffix (' [set 2]', worked out once per set), so the set's
    tensors are rows of their own in the shared file. Control (start/stop/flush/close) stays
    with the `Timeline`; cycle marks are the global set's.
    """

    __slots__ = ("_st", "_q", "_sfx", "process_set_id")

    def __init__(self, timeline: Timeline, process_set_id: int) -> None:
        self._st = timeline._st
        self._q = timeline._q
        self._sfx = f" [set {int(process_set_id)}]"
        self.process_set_id = process_set_id

    def mark_cycle(self) -> None:
        """Cycle marks are global: the coordinator marks them through the `Timeline`."""


def _writer_main(owner_ref: "weakref.ref[Timeline]", q: queue.SimpleQueue,
                 wake: threading.Event) -> None:
    """The writer thread: drain, format, write, answer commands; exits on _C_QUIT."""
    out: FileWriter | None = None
    broken = False  # an I/O error already reported for the current file
    while True:
        batch = [q.get()]
        try:
            while len(batch) < _BATCH:
                batch.append(q.get_nowait())
        except queue.Empty:
            pass
        lo = 0
        for i, ev in enumerate(batch):
            kind = ev[0]
            if kind >= 0:
                continue
            if out is not None and not broken and lo < i:
                out.run(batch, lo, i)
            lo = i + 1
            reply: _Reply = ev[1]
            try:
                if out is not None and not broken:
                    try:
                        out.flush()
                    except OSError as exc:
                        broken = True
                        _log.error("Timeline: cannot write %s: %s", out.path, exc)
                if out is not None and kind != _C_FLUSH:
                    try:
                        os.close(out.fd)
                    except OSError:
                        pass
                    out = None
                if kind == _C_START:
                    broken = False
                    try:
                        out = FileWriter(ev[2], ev[3], ev[4])
                    except Exception as exc:  # noqa: BLE001 - the caller raises it
                        reply.error = exc
            finally:
                reply.done.set()
            if kind == _C_QUIT:
                return
        if out is not None and not broken:
            if lo < len(batch):
                out.run(batch, lo, len(batch))
            try:
                out.flush()
            except OSError as exc:
                broken = True
                _log.error("Timeline: cannot write %s: %s; the rest of this timeline is lost",
                           out.path, exc)
        owner = owner_ref()
        if owner is None:  # abandoned without close(): the file is complete; exit
            if out is not None:
                os.close(out.fd)
            return
        owner._check_backlog(q)
        del owner
        if len(batch) < _BATCH:
            wake.wait(_POLL_S)  # commands (start/stop/flush/close) cut the pause short
            wake.clear()
