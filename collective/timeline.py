"""Horovod's timeline: a Chrome trace-event JSON file of every tensor's life.

The coordinator thread (rank 0 of the global process set) calls the event methods of
`Timeline`. Each call costs about a microsecond: it reads a clock and puts a tuple on a
`queue.SimpleQueue`. A named writer thread (`hvd-timeline-writer`) drains the queue in batches,
runs the per-tensor state machine, formats the records and writes them with one `os.pwrite` per
chunk, so no Python-side buffer holds data that a crash could lose.

File layout (Horovod's, viewable in chrome://tracing and Perfetto)::

    [
    {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": T}},
    {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
    {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.x"}},
    {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
    {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 12, "pid": 1},
    {"ph": "X", "name": "0", "ts": 12, "pid": 1, "dur": 0},
    ...
    {"ph": "E", "ts": 80, "pid": 1, "args": {"dtype": "float32", "shape": "[3, 4]"}}
    ]

Crash safety, by construction. Linux applies a write to a file page by page and stops a write
hit by SIGKILL only between two pages, so a write that stays inside one 4 KiB page lands whole
or not at all. The writer keeps to that:

* the file is created under a temporary name with its header and renamed into place, so the
  path never holds an empty or half-written header;
* a write that fits in the page where the file ends appends ``,`` + records + the tail
  ``\n]\n`` (which the next write overwrites): the file is valid JSON before and after it;
* a write that reaches into the next page first pads the current page with spaces after its
  last whole record, so cutting it at the page boundary leaves whole records followed by
  spaces, with only the closing ``]`` missing (a form Chrome's trace viewer, Perfetto and
  `load_events` read); it never crosses a second boundary;
* names are shortened to 1 KiB, so every record fits in a page.

A file left by a killed job is therefore always ``[`` + whole records, ending in ``]`` unless
the kill landed in the middle of a page-crossing write.

Per-tensor state machine (UNKNOWN → NEGOTIATING → TOP_LEVEL → ACTIVITY), run on the writer
thread and reset for every new file. It tolerates odd call orders instead of asserting as
Horovod does: a call that does not fit the current state is dropped, and a call that opens a
span while another is open closes the open one first, so every file stays balanced.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

from ._log import get_logger

__all__ = ["Timeline", "ACTIVITIES", "QUEUE_CAPACITY"]

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
# Linux stops a write hit by SIGKILL only between pages, so every write stays inside one page or
# crosses one boundary right after whitespace padding (see the module docstring and `flush`).
_PAGE = 4096
# Names are shortened (`_literal`) so that no record comes near a page: with the ",\n" before it
# and the tail after it, every record fits in one.
_MAX_LITERAL = 1024  # longest JSON string literal of a name, quotes included
_TAIL = b"\n]\n"

# Event kinds (tuple[0]); commands are negative so `kind < 0` separates them cheaply.
_NEG_START, _RANK_READY, _NEG_END, _START, _ACT_START, _ACT_END, _END, _END_ERROR, _MARK = range(9)
_C_START, _C_STOP, _C_FLUSH, _C_QUIT = -1, -2, -3, -4

_E_HEAD = '{"ph": "E", "ts": '

# Tensor states; absence from the state dict is UNKNOWN.
_NEGOTIATING, _TOP_LEVEL, _ACTIVITY = 1, 2, 3

_now = time.perf_counter_ns
_log = get_logger()


def _type_name(value: Any) -> str:
    """'ALLREDUCE' for a str or an enum member (RequestType.ALLREDUCE)."""
    return value if isinstance(value, str) else str(getattr(value, "name", value))


def _dtype_name(dtype: Any) -> str:
    """Horovod's DataType_Name: 'float32' for a str, numpy dtype or DataType member."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    return str(name).lower() if name is not None else str(dtype)


def _shape_text(shape: Any) -> str:
    """TensorShape::DebugString: '[3, 4]'; '[]' for a scalar."""
    try:
        text = "[" + ", ".join(str(int(d)) for d in shape) + "]"
    except TypeError:
        text = str(shape)
    return text if len(text) <= 256 else text[:250] + " ...]"


def _literal(name: str) -> str:
    """`name` as a JSON string literal of at most _MAX_LITERAL bytes ('...' marks a cut)."""
    lit = json.dumps(name)
    keep = len(name)
    while len(lit) > _MAX_LITERAL:
        keep = min(keep // 2, _MAX_LITERAL)
        lit = json.dumps(name[:keep] + "...")
    return lit


def create_file(path: str, data: bytes) -> int:
    """Opens `path` for writing holding exactly `data`, never empty or partial in between.

    The data is written to a temporary file in the same directory, which is then renamed over
    `path` (atomic). Paths that are not regular files (a FIFO, /dev/null), or a directory where
    no temporary file can be made, get a plain truncating open.
    """
    tmp = ""
    fd = -1
    if not os.path.exists(path) or os.path.isfile(path):
        tmp = os.path.join(os.path.dirname(path) or ".",
                           f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            tmp = ""
    if fd < 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if tmp:
            os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    return fd


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


class _FileWriter:
    """One open timeline file: pid table, tensor states and the append-at-tail writes."""

    def __init__(self, path: str, t0_ns: int, epoch_us: int) -> None:
        self.path = path
        self.t0 = t0_ns
        self.end = 0  # offset of the tail "\n]\n"
        self.sfx: dict[str, str] = {}  # tensor -> ', "pid": N}' (its pid, pre-formatted)
        self.xsfx: dict[str, str] = {}  # tensor -> ', "pid": N, "dur": 0}'
        self.states: dict[str, int] = {}
        self.parts: list[str] = []
        self.heads: dict[Any, str] = {}  # op/activity -> '{"ph": "B", "name": "...", "ts": '
        self.op_heads: dict[str, str] = {}  # fast path of `heads` for str op names
        self.neg_heads: dict[str, str] = {}  # same, for "NEGOTIATE_<TYPE>"
        self.xheads: dict[Any, str] = {}  # rank -> '{"ph": "X", "name": "<rank>", "ts": '
        self.end_args: dict[Any, str] = {}  # (dtype, shape) -> the End event's args
        self._at = 0  # index of the event being recorded (for skipping a bad one)
        head = ('{"name": "process_name", "ph": "M", "pid": 0, "args": '
                f'{{"start_time_since_epoch_in_micros": {epoch_us}}}}},\n'
                '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}')
        data = ("[\n" + head).encode()
        self.fd = create_file(path, data + _TAIL)
        self.end = len(data)

    # --- record formatting (the writer's hot path) ----------------------------------------
    # Records are built by concatenating cached fragments with str(ts): measured ~1.5x faster
    # than one f-string per record, and this loop is most of the timeline's CPU cost.
    def _sfx(self, name: str) -> str:
        """The record suffix carrying `name`'s pid; emits its metadata on first sight."""
        sfx = self.sfx.get(name)
        if sfx is None:
            pid = len(self.sfx) + 1
            sfx = self.sfx[name] = f', "pid": {pid}}}'
            self.xsfx[name] = f', "pid": {pid}, "dur": 0}}'
            self.parts.append(f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": '
                              f'{{"name": {_literal(name)}}}}}')
            self.parts.append(f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, '
                              f'"args": {{"sort_index": {pid}}}}}')
        return sfx

    def _begin_head(self, value: Any, prefix: str = "") -> str:
        """'{"ph": "B", "name": "<prefix><TYPE>", "ts": ' for a str or enum `value`."""
        # IntEnums of different types compare equal (DataType.UINT8 == RequestType.ALLREDUCE),
        # so non-str keys carry their type.
        key = (prefix, value) if value.__class__ is str else (prefix, value.__class__, value)
        head = self.heads.get(key)
        if head is None:
            lit = _literal(prefix + _type_name(value))
            head = self.heads[key] = f'{{"ph": "B", "name": {lit}, "ts": '
            if value.__class__ is str:  # the fast paths of _run look str values up directly
                (self.neg_heads if prefix else self.op_heads)[value] = head
        return head

    def _close_open(self, name: str, ts: int) -> None:
        """Ends every span open for `name` (innermost first) and forgets its state."""
        state = self.states.pop(name, None)
        if state is not None:
            rec = _E_HEAD + str(ts) + self._sfx(name)
            self.parts.append(rec)
            if state == _ACTIVITY:
                self.parts.append(rec)

    # --- the state machine ----------------------------------------------------------------
    def run(self, evs: Sequence[tuple], lo: int, hi: int) -> None:
        """Records events evs[lo:hi]; a bad event is logged and skipped."""
        i = lo
        while i < hi:
            try:
                self._run(evs, i, hi)
                return
            except Exception:  # a bad argument must not kill the writer
                i = self._at
                _log.exception("Timeline: cannot record event %r; skipping it", evs[i][:2])
                i += 1

    def _run(self, evs: Sequence[tuple], lo: int, hi: int) -> None:
        # One function with local names: this loop is most of the writer's cost.
        states, add, sfxs, t0 = self.states, self.parts.append, self.sfx, self.t0
        xheads, xsfxs, str_ = self.xheads, self.xsfx, str
        op_heads, neg_heads = self.op_heads, self.neg_heads
        for i in range(lo, hi):
            self._at = i
            ev = evs[i]
            kind = ev[0]
            if kind == _MARK:
                ts = (ev[1] - t0) // 1000
                add('{"ph": "i", "name": "CYCLE_START", "ts": ' + str_(ts if ts > 0 else 0)
                    + ', "s": "g"}')
                continue
            ts = (ev[2] - t0) // 1000
            if ts < 0:
                ts = 0
            name = ev[1]
            if kind == _RANK_READY:
                if states.get(name) == _NEGOTIATING:
                    rank = ev[3]
                    head = xheads.get(rank)
                    if head is None:
                        head = xheads[rank] = f'{{"ph": "X", "name": "{int(rank)}", "ts": '
                    add(head + str_(ts) + xsfxs[name])
            elif kind == _ACT_START:
                # One timestamp for the whole (fused) batch: the shared head is built once.
                head = self._begin_head(ev[3]) + str_(ts)
                for name in ev[1]:
                    state = states.get(name)
                    if state == _TOP_LEVEL:
                        add(head + sfxs[name])
                    elif state == _ACTIVITY:  # a new activity without ending the last one
                        sfx = sfxs[name]
                        add(_E_HEAD + str_(ts) + sfx)
                        add(head + sfx)
                    else:
                        continue
                    states[name] = _ACTIVITY
            elif kind == _ACT_END:
                head = _E_HEAD + str_(ts)
                for name in ev[1]:
                    if states.get(name) == _ACTIVITY:
                        add(head + sfxs[name])
                        states[name] = _TOP_LEVEL
            else:
                state = states.get(name)
                if kind == _NEG_START:
                    if state is not None:
                        self._close_open(name, ts)
                    head = neg_heads.get(ev[3])
                    if head is None:
                        head = self._begin_head(ev[3], "NEGOTIATE_")
                    add(head + str_(ts) + (sfxs.get(name) or self._sfx(name)))
                    states[name] = _NEGOTIATING
                elif kind == _NEG_END:
                    if state == _NEGOTIATING:
                        add(_E_HEAD + str_(ts) + sfxs[name])
                        del states[name]
                elif kind == _START:
                    if state is not None:
                        self._close_open(name, ts)
                    head = op_heads.get(ev[3])
                    if head is None:
                        head = self._begin_head(ev[3])
                    add(head + str_(ts) + (sfxs.get(name) or self._sfx(name)))
                    states[name] = _TOP_LEVEL
                elif kind == _END:
                    if state == _ACTIVITY:
                        add(_E_HEAD + str_(ts) + sfxs[name])
                        state = _TOP_LEVEL
                    if state == _TOP_LEVEL:
                        add(_E_HEAD + str_(ts) + sfxs[name][:-1] + self._end_args(ev[3], ev[4]))
                        del states[name]
                    elif state is not None:
                        self._close_open(name, ts)
                elif kind == _END_ERROR:
                    self._close_open(name, ts)

    def _end_args(self, dtype: Any, shape: Any) -> str:
        """', "args": {"dtype": "float32", "shape": "[3, 4]"}}' (cached per dtype/shape)."""
        key = (dtype, shape) if dtype.__class__ is str and shape.__class__ is tuple else None
        if key is not None:
            text = self.end_args.get(key)
            if text is not None:
                return text
        text = (f', "args": {{"dtype": {_literal(_dtype_name(dtype))}, '
                f'"shape": "{_shape_text(shape)}"}}}}')
        if key is not None and len(self.end_args) < 65536:
            self.end_args[key] = text
        return text

    # --- I/O --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Appends the formatted records, a page at a time (see the module docstring)."""
        parts = self.parts
        if not parts:
            return
        self.parts = []
        # Records are single-line ASCII (names go through json.dumps), so ",\n" occurs only
        # between records: every ",\n" in `data` is a place where whole records end.
        data = (",\n" + ",\n".join(parts)).encode("ascii")
        fd, off, pos, total = self.fd, self.end, 0, len(data)
        while pos < total:  # data[pos] is a separator, written at file offset `off`
            page_end = (off // _PAGE + 1) * _PAGE
            room = page_end - 3 - off  # the tail must stay in this page
            if total - pos <= room:
                os.pwrite(fd, data[pos:] + _TAIL, off)
                off += total - pos
                break
            # Whole records that fit, spaces up to the boundary, then whole records that fit
            # in the next page: a kill can cut this write only at the boundary.
            cut = data.rfind(b",\n", pos + 1, pos + room + 2)
            if cut < 0:
                cut = pos
            nxt = total if total - cut <= _PAGE - 3 else data.rfind(
                b",\n", cut + 1, cut + _PAGE - 1)
            if nxt < 0:  # a record longer than a page (names are shortened, so never)
                nxt = data.find(b",\n", cut + 2)
                nxt = total if nxt < 0 else nxt
            pad = page_end - off - (cut - pos)
            os.pwrite(fd, data[pos:cut] + b" " * pad + data[cut:nxt] + _TAIL, off)
            off = page_end + (nxt - cut)
            pos = nxt
        self.end = off


class Timeline:
    """Rank 0's timeline; see the module docstring for the file format.

    The event methods may be called from one thread (the coordinator); `start_file`,
    `stop_file`, `flush` and `close` from any thread. Event methods do nothing unless `enabled`.

    Args:
        path: file to write from now on; "" (or "DYNAMIC") to wait for `start_file`.
        mark_cycles: write a `CYCLE_START` instant event on every `mark_cycle()`.
    """

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set with every command so the writer skips its pause
        self._lock = threading.Lock()  # serialises start/stop/flush/close
        self._thread: threading.Thread | None = None
        self._on = False  # a file is open (the `enabled` property)
        self._live = False  # events are accepted: `_on` and the queue is not overfull
        self._mark = bool(mark_cycles)
        self._path = ""
        self._dropping = False
        if path and path != "DYNAMIC":
            try:
                self.start_file(path, mark_cycles)
            except OSError as exc:
                # Horovod logs and runs on without a timeline rather than failing init().
                _log.error("Error opening the Horovod Timeline file %s, will not write a "
                           "timeline: %s", path, exc)

    # --- event methods (the coordinator's hot path) -----------------------------------------
    @property
    def enabled(self) -> bool:
        """True while a file is being written."""
        return self._on

    @property
    def path(self) -> str:
        """The file being written, or "" when stopped."""
        return self._path

    @property
    def mark_cycles(self) -> bool:
        return self._mark

    def negotiate_start(self, name: str, request_type: Any) -> None:
        """`B NEGOTIATE_<TYPE>` on the tensor's first request (`request_type` 'ALLREDUCE')."""
        if self._live:
            self._q.put((_NEG_START, name, _now(), request_type))

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        """An `X` event named after the rank whose request for `name` just arrived."""
        if self._live:
            self._q.put((_RANK_READY, name, _now(), rank))

    def negotiate_end(self, name: str) -> None:
        """`E` closing the negotiation of `name`."""
        if self._live:
            self._q.put((_NEG_END, name, _now()))

    def start(self, name: str, response_type: Any) -> None:
        """`B <TYPE>` (top level, e.g. 'ALLREDUCE') when the operation on `name` begins."""
        if self._live:
            self._q.put((_START, name, _now(), response_type))

    def activity_start_all(self, names: Sequence[str], activity: str) -> None:
        """A nested `B <activity>` for every tensor of a (fused) response."""
        if self._live:
            self._q.put((_ACT_START, tuple(names), _now(), activity))

    def activity_end_all(self, names: Sequence[str]) -> None:
        """`E` for the current activity of every tensor in `names`."""
        if self._live:
            self._q.put((_ACT_END, tuple(names), _now()))

    def activity_start(self, name: str, activity: str) -> None:
        """`activity_start_all` for one tensor."""
        if self._live:
            self._q.put((_ACT_START, (name,), _now(), activity))

    def activity_end(self, name: str) -> None:
        """`activity_end_all` for one tensor."""
        if self._live:
            self._q.put((_ACT_END, (name,), _now()))

    def end(self, name: str, dtype: Any, shape: Iterable[int]) -> None:
        """`E` of the top-level span with args dtype ('float32') and shape ('[3, 4]')."""
        if self._live:
            self._q.put((_END, name, _now(), dtype, shape))

    def end_error(self, name: str) -> None:
        """Closes whatever is open for `name` (the op failed), without args."""
        if self._live:
            self._q.put((_END_ERROR, name, _now()))

    def mark_cycle(self) -> None:
        """A global instant event `CYCLE_START`, when marking cycles."""
        if self._live and self._mark:
            self._q.put((_MARK, _now()))

    # --- control ----------------------------------------------------------------------------
    def start_file(self, path: str, mark_cycles: bool) -> None:
        """Starts writing `path` (truncated), or switches to it; blocks until the writer has.

        The same path as the one being written is a no-op (only `mark_cycles` is updated).
        Events queued before the call go to the old file; the new file's timestamps count
        from this call.

        Raises:
            ValueError: `path` is empty.
            OSError: the file cannot be created; the timeline is then stopped.
            RuntimeError: the writer thread has died.
        """
        if not path:
            raise ValueError("start_timeline needs a file path, e.g. "
                             "hvd.start_timeline('/tmp/timeline.json')")
        with self._lock:
            self._mark = bool(mark_cycles)
            if self._on and path == self._path:
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
                self._on = self._live = False
                self._path = ""
                err = reply.error
                raise OSError(getattr(err, "errno", None),
                              f"cannot write the timeline file {path!r}: {err}; check that its "
                              "directory exists and is writable") from err
            self._path, self._on, self._live, self._dropping = path, True, True, False

    def stop_file(self) -> None:
        """Stops writing; blocks until every queued event is in the file and it is closed.

        Raises:
            RuntimeError: the writer thread has died.
        """
        with self._lock:
            if not self._on:
                _log.info("Timeline is already stopped; ignoring the stop request.")
                return
            self._on = self._live = False
            self._command(_C_STOP)
            self._path = ""

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
            self._on = self._live = False
            self._path = ""
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
        try:
            ref = weakref.ref(self)
            threading._register_atexit(lambda: (t := ref()) is not None and t.close())
        except (AttributeError, RuntimeError):  # interpreter already shutting down
            pass

    # Called on the writer thread after each batch.
    def _check_backlog(self, q: queue.SimpleQueue) -> None:
        pending = q.qsize()
        if pending > QUEUE_CAPACITY and self._live:
            self._live = False
            if not self._dropping:
                self._dropping = True
                _log.warning("Timeline writer is more than %d events behind; dropping timeline "
                             "events until it catches up (the file may show unclosed spans).",
                             QUEUE_CAPACITY)
        elif not self._live and pending < QUEUE_CAPACITY // 2 and self._on:
            if self._lock.acquire(blocking=False):  # start/stop own the flags while they run
                try:
                    if self._on:
                        self._live = True
                finally:
                    self._lock.release()


def _writer_main(owner_ref: "weakref.ref[Timeline]", q: queue.SimpleQueue,
                 wake: threading.Event) -> None:
    """The writer thread: drain, format, write, answer commands; exits on _C_QUIT."""
    out: _FileWriter | None = None
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
                        out = _FileWriter(ev[2], ev[3], ev[4])
                    except OSError as exc:
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


if __name__ == "__main__":
    import sys

    from .timeline_cli import main

    sys.exit(main())
