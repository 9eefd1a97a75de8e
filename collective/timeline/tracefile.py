"""The timeline file: Horovod's Chrome trace-event JSON, written crash-safe.

`FileWriter` runs on the timeline's writer thread (`writer.Timeline`): it takes the queued
events (the `_NEG_START` ... `_MARK` tuples below), runs the per-tensor state machine, formats
the records and writes them with one `os.pwrite` per chunk, so no Python-side buffer holds data
that a crash could lose.

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
import secrets
from typing import Any, Sequence

from .._log import get_logger

__all__ = ["FileWriter", "create_file"]

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

_log = get_logger()


def _pwrite_all(fd: int, data: bytes, off: int) -> None:
    """`os.pwrite` of all of `data` at `off`: a short write (a nearly full disk) writes the
    rest, or raises the error that stopped it (ENOSPC), instead of leaving a torn record
    behind an `end` that counts it whole."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(28, "no space left for the timeline (short write)")
        view, off = view[n:], off + n

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
    `path` (atomic). Paths that are not regular files (/dev/null), or a directory where no
    temporary file can be made, get a plain truncating open. The records are written at
    offsets (`os.pwrite`), so a FIFO fails here ("Illegal seek"), as it does with Horovod.
    """
    tmp = ""
    fd = -1
    if not os.path.exists(path) or os.path.isfile(path):
        # A name nobody can guess, created here and nowhere else (O_EXCL: a file or symlink
        # another user planted under it fails the open), or a shared directory such as /tmp
        # would let them redirect the write and the rename.
        tmp = os.path.join(os.path.dirname(path) or ".",
                           f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError:
            tmp = ""
    if fd < 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, data, 0)
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


class FileWriter:
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
                _pwrite_all(fd, data[pos:] + _TAIL, off)
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
            _pwrite_all(fd, data[pos:cut] + b" " * pad + data[cut:nxt] + _TAIL, off)
            off = page_end + (nxt - cut)
            pos = nxt
        self.end = off
