"""Pure negotiation logic: the response cache, rank 0's message table, response validation, and
the set of cache hits a rank waits on (`PendingHits`, the fast path's bit vector).

No threads and no I/O here; the coordinator wires these to a control plane. Every rank applies
the same cache operations in the same order, so cache bit numbering stays identical everywhere.
"""
from __future__ import annotations

import enum
import itertools
import re
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .types import (CPU_DEVICE, DataType, ReduceOp, Request, RequestType, Response,
                    ResponseType)
from .wire import MAX_DIMS, MAX_STR_BYTES, WireError, clip_text, quote_name

__all__ = ["CacheState", "ResponseCache", "MessageTable", "PendingHits", "encode_requests",
           "decode_requests", "decode_gathered", "encode_responses", "decode_responses", "CACHEABLE",
           "bit_indices"]

CACHEABLE = (ResponseType.ALLREDUCE, ResponseType.ALLGATHER, ResponseType.ADASUM,
             ResponseType.ALLTOALL)

EVICTION_WARNING = (
    "A response has been evicted from cache which may indicate reduced performance. Better "
    "performance may be obtained by disabling caching (HOROVOD_CACHE_CAPACITY=0) or increasing "
    "the cache capacity (HOROVOD_CACHE_CAPACITY>{capacity}).")  # the capacity in force


class CacheState(enum.Enum):
    MISS = 0
    HIT = 1
    INVALID = 2


def _params(req: Request) -> tuple:
    return (int(req.type), int(req.dtype), tuple(req.shape), req.device >= 0, req.prescale,
            req.postscale, int(req.reduce_op), req.layout)


@dataclass
class _Cached:
    response: Response
    params: tuple


class ResponseCache:
    """LRU cache of single-tensor responses; each entry owns a bit of the fast-path vector."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[str, _Cached] = OrderedDict()  # LRU first, MRU last
        self._bit_of: dict[str, int] = {}
        self._name_at: list[str | None] = []  # bit -> name (None = hole)
        self.evicted_once = False

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_bits(self) -> int:
        return len(self._name_at)

    def lookup(self, req: Request) -> tuple[CacheState, int]:
        c = self._lru.get(req.name)
        if c is None:
            return CacheState.MISS, -1
        bit = self._bit_of[req.name]
        return (CacheState.HIT if c.params == _params(req) else CacheState.INVALID), bit

    def put(self, response: Response, req: Request) -> bool:
        """Caches a single-tensor response; returns True if an entry was evicted."""
        name = response.names[0]
        if name in self._lru:
            self._lru[name] = _Cached(response, _params(req))
            self._lru.move_to_end(name)
            return False
        evicted = False
        if len(self._lru) >= self.capacity:
            old, _ = self._lru.popitem(last=False)
            bit = self._bit_of.pop(old)
            self._name_at[bit] = name
            evicted = True
        else:
            bit = len(self._name_at)
            self._name_at.append(name)
        self._bit_of[name] = bit
        self._lru[name] = _Cached(response, _params(req))
        return evicted

    def peek(self, bit: int) -> Response:
        return self._lru[self._name_at[bit]].response  # type: ignore[index]

    def get(self, bit: int) -> Response:
        """The cached response for `bit`, marked most recently used."""
        name = self._name_at[bit]
        assert name is not None
        self._lru.move_to_end(name)
        return self._lru[name].response

    def name_of(self, bit: int) -> str | None:
        return self._name_at[bit] if 0 <= bit < len(self._name_at) else None

    def erase(self, bit: int) -> None:
        name = self._name_at[bit]
        if name is None:
            return
        self._name_at[bit] = None
        del self._bit_of[name]
        del self._lru[name]

    def renumber(self) -> None:
        """Compacts holes; the least recently used entry gets bit 0."""
        self._name_at = list(self._lru)
        self._bit_of = {n: i for i, n in enumerate(self._name_at)}

    def clear(self) -> None:
        self._lru.clear()
        self._bit_of.clear()
        self._name_at.clear()


# -- wire format (control plane payloads) -----------------------------------------------------
# Fixed-layout fields, never pickle: a peer's message is data, not code (collective/wire.py).
_REQ_MAGIC, _RESP_MAGIC = b"RQ2", b"RS2"
_REQ_HEAD = struct.Struct("<IB")  # count, shutdown
_REQ_ROW = struct.Struct("<iBBiiBddQB")  # rank type dtype device root op pre post layout ndim
_RESP_HEAD = struct.Struct("<IBB")  # count, shutdown, join_active
# With join_active set, the header is followed by the global ranks that have joined: a count
# (u32), then one i32 each (`encode_responses`).
_RESP_ROW = struct.Struct("<BBBiiiddIII")  # type dtype op device root last pre post n_names
#                                            n_sizes n_shapes
_DIMS = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]
_U32 = struct.Struct("<I")
_REQUEST_TYPES = {int(v): v for v in RequestType}
_RESPONSE_TYPES = {int(v): v for v in ResponseType}
_DATA_TYPES = {int(v): v for v in DataType}
_REDUCE_OPS = {int(v): v for v in ReduceOp}


def encode_requests(reqs: Sequence[Request], shutdown: bool) -> bytes:
    parts = [_REQ_MAGIC, _REQ_HEAD.pack(len(reqs), bool(shutdown))]
    add = parts.append
    for r in reqs:
        shape = r.shape
        name = r.name.encode("utf-8", "surrogatepass")
        if len(name) > MAX_STR_BYTES or len(shape) > MAX_DIMS:
            raise WireError(f"tensor {r.name[:60]!r}: name longer than {MAX_STR_BYTES} bytes "
                            f"or rank above {MAX_DIMS}")
        add(_REQ_ROW.pack(r.rank, r.type, r.dtype, r.device, r.root, r.reduce_op, r.prescale,
                          r.postscale, r.layout, len(shape)))
        if shape:
            add(_DIMS[len(shape)].pack(*shape))
        add(_U32.pack(len(name)))
        add(name)
    return b"".join(parts)


def decode_requests(data: bytes) -> tuple[list[Request], bool]:
    """Raises: WireError: `data` is not a well-formed request list."""
    data = bytes(data)
    end = len(data)
    if data[:3] != _REQ_MAGIC or end < 3 + _REQ_HEAD.size:
        raise WireError(f"malformed request list: bad header {data[:8]!r}")
    n, shutdown = _REQ_HEAD.unpack_from(data, 3)
    pos = 3 + _REQ_HEAD.size
    row = _REQ_ROW.size
    if n * (row + 4) > end - pos:
        raise WireError(f"malformed request list: {n} requests cannot fit in {end} bytes")
    out = []
    try:
        for _ in range(n):
            if pos + row > end:
                raise WireError("truncated")
            rank, rtype, dtype, device, root, op, pre, post, layout, ndim = (
                _REQ_ROW.unpack_from(data, pos))
            pos += row
            if ndim:
                st = _DIMS[ndim]  # IndexError past MAX_DIMS
                if pos + st.size > end:
                    raise WireError("truncated shape")
                shape = st.unpack_from(data, pos)
                pos += st.size
                if min(shape) < 0:
                    raise WireError(f"negative dimension in {shape}")
            else:
                shape = ()
            if pos + 4 > end:
                raise WireError("truncated name")
            (ln,) = _U32.unpack_from(data, pos)
            pos += 4
            if pos + ln > end:
                raise WireError("truncated name")
            name = data[pos:pos + ln].decode("utf-8", "surrogatepass")
            pos += ln
            out.append(Request(rank, _REQUEST_TYPES[rtype], name, _DATA_TYPES[dtype], shape,
                               device, root, _REDUCE_OPS[op], pre, post, layout=layout))
    except WireError as exc:
        raise WireError(f"malformed request list: {exc} at offset {pos}") from None
    except (KeyError, IndexError, UnicodeDecodeError, struct.error) as exc:
        raise WireError(f"malformed request list: bad field ({type(exc).__name__}: {exc}) "
                        f"at offset {pos}") from None
    if pos != end:
        raise WireError(f"malformed request list: {end - pos} unexpected bytes after the end")
    return out, bool(shutdown)


def decode_gathered(gathered: Sequence[bytes], ranks: Sequence[int]) -> list[list[Request]]:
    """Every rank's request list (rank 0 of a set, slow path).

    Raises:
        WireError: a rank's message is malformed, naming that rank.
    """
    out = []
    for i, data in enumerate(gathered):
        try:
            out.append(decode_requests(data)[0])
        except WireError as exc:
            raise WireError(f"rank {ranks[i]} sent a {exc}; it is not a ringvod rank of this "
                            "version, or the connection is corrupt (a job without "
                            "HOROVOD_SECRET_KEY accepts any process as a rank)") from None
    return out


def _pack_strs(parts: list, strs: Sequence[str]) -> None:
    """u32 total bytes + the UTF-8 names separated by NUL (the usual case, split in C), or,
    when a name contains NUL, u32 0xFFFFFFFF + u32 byte lengths + the names concatenated."""
    if not strs:
        return
    joined = "\0".join(strs)
    if joined.count("\0") == len(strs) - 1:
        blob = joined.encode("utf-8", "surrogatepass")
        parts.append(_U32.pack(len(blob)))
        parts.append(blob)
        return
    enc = [x.encode("utf-8", "surrogatepass") for x in strs]
    lens = [len(e) for e in enc]
    parts.append(_U32.pack(0xFFFFFFFF))
    parts.append(struct.pack(f"<{len(lens)}I", *lens))
    parts.append(b"".join(enc))


def encode_responses(resps: Sequence[Response], shutdown: bool, join_active: bool,
                     joined: Sequence[int] = ()) -> bytes:
    """The response list rank 0 broadcasts. `joined`: the ranks that have joined (global
    rounds only; sent only with `join_active`)."""
    parts = [_RESP_MAGIC, _RESP_HEAD.pack(len(resps), bool(shutdown), bool(join_active))]
    if join_active:
        parts.append(_U32.pack(len(joined)))
        if joined:
            parts.append(struct.pack(f"<{len(joined)}i", *joined))
    add = parts.append
    for r in resps:
        err = clip_text(r.error) if r.error else b""
        shapes = r.shapes
        add(_RESP_ROW.pack(r.type, r.dtype, r.reduce_op, r.device, r.root, r.last_joined_rank,
                           r.prescale, r.postscale, len(r.names), len(r.sizes), len(shapes)))
        _pack_strs(parts, r.names)
        if r.sizes:
            add(struct.pack(f"<{len(r.sizes)}q", *r.sizes))
        if shapes:
            ndims = [len(sh) for sh in shapes]
            if max(ndims) > MAX_DIMS:
                raise WireError(f"tensor rank {max(ndims)} exceeds {MAX_DIMS}")
            add(bytes(ndims))
            dims = list(itertools.chain.from_iterable(shapes))
            if dims:
                add(struct.pack(f"<{len(dims)}q", *dims))
        add(_U32.pack(len(err)))
        add(err)
    return b"".join(parts)


def decode_responses(data: bytes) -> tuple[list[Response], bool, bool, tuple[int, ...]]:
    """(responses, shutdown, join_active, joined ranks) of `encode_responses`.

    Raises:
        WireError: `data` is not a well-formed response list.
    """
    data = bytes(data)
    end = len(data)
    if data[:3] != _RESP_MAGIC or end < 3 + _RESP_HEAD.size:
        raise WireError(f"malformed response list: bad header {data[:8]!r}")
    n, shutdown, join_active = _RESP_HEAD.unpack_from(data, 3)
    pos = 3 + _RESP_HEAD.size
    joined: tuple[int, ...] = ()
    if join_active:
        if end - pos < 4:
            raise WireError("malformed response list: truncated joined ranks")
        (k,) = _U32.unpack_from(data, pos)
        pos += 4
        if 4 * k > end - pos:
            raise WireError(f"malformed response list: {k} joined ranks cannot fit in "
                            f"{end} bytes")
        if k:
            joined = struct.unpack_from(f"<{k}i", data, pos)
            pos += 4 * k
            if min(joined) < 0 or len(set(joined)) != k:
                raise WireError(f"malformed response list: joined ranks {list(joined)[:8]} "
                                "are not distinct ranks")
    row = _RESP_ROW.size
    if n * (row + 4) > end - pos:
        raise WireError(f"malformed response list: {n} responses cannot fit in {end} bytes")
    out = []

    def need(k: int, what: str) -> None:
        if k < 0 or pos + k > end:
            raise WireError(f"truncated {what}")

    try:
        for _ in range(n):
            need(row, "response")
            (rtype, dtype, op, device, root, last, pre, post, n_names, n_sizes,
             n_shapes) = _RESP_ROW.unpack_from(data, pos)
            pos += row
            names: list[str] = []
            if n_names:
                need(4, "names")
                (total,) = _U32.unpack_from(data, pos)
                pos += 4
                if total != 0xFFFFFFFF:
                    need(total, "names")
                    names = data[pos:pos + total].decode("utf-8", "surrogatepass").split("\0")
                    pos += total
                    if len(names) != n_names:
                        raise WireError(f"{len(names)} names where {n_names} were announced")
                else:
                    need(4 * n_names, "name lengths")
                    lens = struct.unpack_from(f"<{n_names}I", data, pos)
                    pos += 4 * n_names
                    total = sum(lens)
                    need(total, "names")
                    blob, off = data[pos:pos + total], 0
                    pos += total
                    for ln in lens:
                        names.append(blob[off:off + ln].decode("utf-8", "surrogatepass"))
                        off += ln
            sizes: list[int] = []
            if n_sizes:
                need(8 * n_sizes, "sizes")
                sizes = list(struct.unpack_from(f"<{n_sizes}q", data, pos))
                pos += 8 * n_sizes
            shapes: list[tuple[int, ...]] = []
            if n_shapes:
                need(n_shapes, "shape ranks")
                ndims = data[pos:pos + n_shapes]
                pos += n_shapes
                if max(ndims) > MAX_DIMS:
                    raise WireError(f"tensor rank {max(ndims)} exceeds {MAX_DIMS}")
                total = sum(ndims)
                need(8 * total, "shapes")
                dims = struct.unpack_from(f"<{total}q", data, pos) if total else ()
                pos += 8 * total
                if dims and min(dims) < 0:
                    raise WireError("negative dimension")
                k = ndims[0]
                if k and ndims.count(k) == n_shapes:  # all of one rank: split in C
                    it = iter(dims)
                    shapes = list(zip(*([it] * k)))
                else:
                    off = 0
                    for k in ndims:
                        shapes.append(dims[off:off + k])
                        off += k
            need(4, "error text")
            (ln,) = _U32.unpack_from(data, pos)
            pos += 4
            need(ln, "error text")
            error = data[pos:pos + ln].decode("utf-8", "surrogatepass") if ln else ""
            pos += ln
            out.append(Response(_RESPONSE_TYPES[rtype], names, _DATA_TYPES[dtype], device,
                                sizes, _REDUCE_OPS[op], pre, post, root, error, last, shapes))
    except WireError as exc:
        raise WireError(f"malformed response list: {exc} at offset {pos}") from None
    except (KeyError, IndexError, UnicodeDecodeError, struct.error) as exc:
        raise WireError(f"malformed response list: bad field ({type(exc).__name__}: {exc}) "
                        f"at offset {pos}") from None
    if pos != end:
        raise WireError(f"malformed response list: {end - pos} unexpected bytes after the end")
    return out, bool(shutdown), bool(join_active), joined


# -- rank 0's message table -------------------------------------------------------------------
def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _ranks_str(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


_MEMBER = re.compile(r"_(\d+)of(\d+)$")  # a grouped op's member: `<group>_<i>of<n>` (ops.py)


def _group_of(name: str) -> tuple[str, int] | None:
    """(group name, member count) of a grouped op's member name, else None."""
    if not name.startswith("grouped_"):
        return None
    m = _MEMBER.search(name)
    return None if m is None else (name[:m.start()], int(m.group(2)))


class MessageTable:
    """Rank 0 of a process set: counts requests per name and builds validated responses.

    A grouped op's members carry the group's size in their names (`g_1of3`), so ranks that
    pass different numbers of tensors to one grouped op submit names no other rank does:
    instead of waiting forever, the group fails on every rank once every rank has submitted
    some of it and two ranks are seen to disagree (`_group_mismatch`)."""

    def __init__(self, size: int, global_ranks: list[int]) -> None:
        self.size = size
        self.global_ranks = global_ranks
        # name -> {ps rank: Request}; insertion order = order of first sight
        self.table: dict[str, dict[int, Request]] = {}
        self.first_seen: dict[str, float] = {}
        self.joined: set[int] = set()
        self.last_joined = -1
        # group name -> {member count: its pending member names}, for grouped ops' members
        self._groups_pending: dict[str, dict[int, set[str]]] = {}

    @property
    def join_active(self) -> bool:
        return bool(self.joined)

    def pending(self) -> dict[str, tuple[set[int], float]]:
        """name -> (ps ranks that submitted, first-seen time); for the stall inspector."""
        return {n: (set(reqs), self.first_seen[n]) for n, reqs in self.table.items()}

    def process(self, request_lists: Sequence[Sequence[Request]],
                on_first=None, on_rank=None) -> list[Response]:
        """Adds every rank's new requests (in rank order); returns the responses now ready.

        `on_first(name, type)` and `on_rank(name, rank)` feed the timeline.
        """
        ready: list[str] = []
        joined_now = False
        now = time.monotonic()
        grouped: set[str] = set()  # groups pending in more than one size with a new request
        for rank, reqs in enumerate(request_lists):
            for req in reqs:
                if req.type == RequestType.JOIN:
                    self.joined.add(rank)
                    self.last_joined = self.global_ranks[rank]
                    joined_now = True
                    continue
                g = _group_of(req.name)
                slot = self.table.get(req.name)
                if slot is None:
                    slot = self.table[req.name] = {}
                    self.first_seen[req.name] = now
                    if on_first is not None:
                        on_first(req.name, req.type)
                    if g is not None:
                        self._groups_pending.setdefault(g[0], {}).setdefault(
                            g[1], set()).add(req.name)
                if g is not None and len(self._groups_pending[g[0]]) > 1:
                    grouped.add(g[0])
                slot[rank] = req
                if on_rank is not None:
                    on_rank(req.name, self.global_ranks[rank])
                if len(slot.keys() | self.joined) == self.size and req.name not in ready:
                    ready.append(req.name)
        if joined_now:  # names waiting only for ranks that have now joined
            for name, slot in self.table.items():
                if name not in ready and len(slot.keys() | self.joined) == self.size:
                    ready.append(name)
            grouped.update(g for g, counts in self._groups_pending.items() if len(counts) > 1)
        failed: list[Response] = []
        for group in grouped:
            err = self._group_mismatch(group)
            if err is not None:
                failed.append(err)
                gone = set(err.names)
                ready = [n for n in ready if n not in gone]
        responses = failed + [self._construct(name) for name in ready]
        if len(self.joined) == self.size:
            responses.append(Response(type=ResponseType.JOIN, names=["join.noname"],
                                      last_joined_rank=self.last_joined))
            self.joined.clear()
            self.last_joined = -1
        return responses

    def waits_for(self, ranks: set[int]) -> bool:
        """Some pending name lacks the request of one of `ranks` (set ranks)."""
        return any(not ranks <= slot.keys() for slot in self.table.values())

    def fail_waiting_for(self, ranks: set[int], ps_id: int) -> list[Response]:
        """ERROR responses for the pending names that lack the request of one of `ranks`: set
        ranks that called `join()` on the global process set and wait there, so they will not
        submit ops of this set (process set `ps_id`, which is not the global one). The names
        leave the table; a later request of the same name starts a new entry."""
        out = []
        for name in [n for n, slot in self.table.items() if not ranks <= slot.keys()]:
            slot = self._take(name)
            first = slot[min(slot)]
            joined = _ranks_str(sorted(self.global_ranks[r] for r in ranks - slot.keys()))
            sent = _ranks_str(sorted(self.global_ranks[r] for r in slot))
            out.append(self._error(name, (
                f"The {first.type.name} of tensor {quote_name(name)} on process set {ps_id} "
                f"(ranks {list(self.global_ranks)}) cannot complete: rank(s) {joined} called "
                f"hvd.join() and wait there without submitting it (rank(s) {sent} submitted "
                "it). join() covers the global process set only: joined ranks contribute "
                "zeros to allreduces of the global process set and take no part in ops of "
                f"other process sets. Finish the ops on process set {ps_id} on every member "
                "before calling hvd.join(), or run this op on the global process set (for an "
                "allreduce).")))
        return out

    def _error(self, name: str, message: str) -> Response:
        return Response(type=ResponseType.ERROR, names=[name], error=message)

    def _take(self, name: str) -> dict[int, Request]:
        """Removes a pending name from the table; returns its requests."""
        self.first_seen.pop(name, None)
        g = _group_of(name)
        if g is not None:
            counts = self._groups_pending.get(g[0])
            names = counts.get(g[1]) if counts is not None else None
            if names is not None:
                names.discard(name)
                if not names:
                    del counts[g[1]]
                if not counts:
                    del self._groups_pending[g[0]]
        return self.table.pop(name)

    def _group_mismatch(self, group: str) -> Response | None:
        """One ERROR response for every pending member of `group` when two ranks passed it
        different numbers of tensors: some rank submitted members of an n1-tensor group that
        another rank did not, and that rank members of an n2-tensor group the first did not.
        (A rank one step ahead with the same group of another size has also submitted the
        size the others are at, so it never looks like this.) Only once every rank has
        submitted some member (or joined): the error then reaches every rank's entries in the
        same response, and no rank submits its part after the group failed elsewhere.
        The response names every member of every size seen, pending here or not: a rank's
        other members may still wait as cache hits (`execute.perform` drops them too)."""
        counts = self._groups_pending.get(group, {})
        ranks = {n: set().union(*(self.table[nm].keys() for nm in members))
                 for n, members in counts.items()}
        if len(set().union(*ranks.values()) | self.joined) < self.size:
            return None
        if not any(ranks[a] - ranks[b] and ranks[b] - ranks[a]
                   for a in ranks for b in ranks if a < b):
            return None
        all_names = [f"{group}_{i}of{n}" for n in sorted(ranks) for i in range(1, n + 1)]
        for nm in all_names:
            if nm in self.table:
                self._take(nm)
        # A rank with members of several sizes is a step ahead: either size may be its own.
        ahead = {r for a in ranks for b in ranks if a < b for r in ranks[a] & ranks[b]}

        def named(rs: set[int]) -> str:
            return _ranks_str(sorted(self.global_ranks[r] for r in rs))
        sent = "; ".join(f"rank(s) {named(ranks[n] - ahead)} passed {n} "
                         f"tensor{'s' if n != 1 else ''}" for n in sorted(ranks)
                         if ranks[n] - ahead)
        if ahead:
            sent += (f"; rank(s) {named(ahead)} submitted it with "
                     f"{' and '.join(str(n) for n in sorted(ranks))} tensors (a later step's "
                     "op under the same name too)")
        kind = group[len("grouped_"):].split(".", 1)[0]
        return Response(type=ResponseType.ERROR, names=all_names, error=(
            f"Mismatched grouped {kind} sizes: {sent} (group {quote_name(group)}). Every rank "
            "must pass the same number of tensors to a grouped op under one name (e.g. the "
            "same model's gradients, in the same order)."))

    def _groups(self, reqs: dict[int, Request], key) -> str | None:
        """'rank(s) 0, 2 sent X; rank(s) 1 sent Y' when ranks disagree on key, else None."""
        by_value: dict = {}
        for r in sorted(reqs):
            by_value.setdefault(key(reqs[r]), []).append(self.global_ranks[r])
        if len(by_value) == 1:
            return None
        return "; ".join(f"rank(s) {_ranks_str(rs)} sent {v}" for v, rs in by_value.items())

    def _construct(self, name: str) -> Response:
        reqs = self._take(name)
        ranks = sorted(reqs)
        first = reqs[ranks[0]]

        def mismatch(key, text) -> Response | None:
            groups = self._groups(reqs, key)
            if groups is None:
                return None
            odd = next(r for r in ranks if key(reqs[r]) != key(first))
            return self._error(name, (
                f"{text(first, reqs[odd])} (tensor {quote_name(name)}: {groups}; every rank "
                "must submit the same tensor under the same name)"))

        op = first.type
        checks = [
            (lambda r: r.dtype.label, lambda a, b: (
                f"Mismatched data types: One rank had type {a.dtype.label}, but another rank "
                f"had type {b.dtype.label}.")),
            (lambda r: r.type.name, lambda a, b: (
                f"Mismatched operations: One rank did an {a.type.name}, but another rank did an "
                f"{b.type.name}.")),
        ]
        for key, text in checks:
            err = mismatch(key, text)
            if err:
                return err
        joined = bool(self.joined)
        if op in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.BROADCAST,
                  RequestType.REDUCESCATTER):
            err = mismatch(lambda r: _shape_str(r.shape), lambda a, b: (
                f"Mismatched {op.name} tensor shapes: One rank sent a tensor of shape "
                f"{_shape_str(a.shape)}, but another rank sent a tensor of shape "
                f"{_shape_str(b.shape)}."))
            if err:
                return err
        err = mismatch(lambda r: f"layout {r.layout:#x}", lambda a, b: (
            f"Mismatched {op.name} tensor layouts: the tensor packs tensors whose shapes differ "
            "across ranks (e.g. a DistributedOptimizer gradient bucket of a model that is not "
            "the same on every rank), or it is one of a TensorFlow step's gradients and the "
            "ranks have gradients (not None) for different variables (a tf.function traced "
            "differently on some rank: give every rank the same model code, or pass "
            "unconnected_gradients=tf.UnconnectedGradients.ZERO)."))
        if err:
            return err
        if op in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.REDUCESCATTER):
            err = mismatch(lambda r: (r.prescale, r.postscale), lambda a, b: (
                f"Mismatched prescale and/or postscale factors: One rank sent factors "
                f"({a.prescale}, {a.postscale}), but another rank sent factors "
                f"({b.prescale}, {b.postscale})."))
            if err:
                return err
        if op in (RequestType.ALLREDUCE, RequestType.REDUCESCATTER):
            err = mismatch(lambda r: int(r.reduce_op), lambda a, b: (
                f"Mismatched reduction operation: One rank sent reduction op "
                f"{int(a.reduce_op)}, but another rank sent reduction op {int(b.reduce_op)}."))
            if err:
                return err
        if op in (RequestType.ALLGATHER, RequestType.ALLTOALL):
            if joined:
                return self._error(name, (
                    "Allgather is not supported with Join at this time. Specify "
                    "sparse_to_dense=True if using DistributedOptimizer"
                    if op == RequestType.ALLGATHER else
                    "Alltoall is not supported with Join at this time."))
            if len(first.shape) == 0:
                return self._error(name, (
                    f"Process-set rank zero tried to {op.name} a rank-zero tensor. "
                    f"(tensor {quote_name(name)}; use a tensor with at least one dimension)"))
            err = mismatch(lambda r: len(r.shape), lambda a, b: (
                f"Mismatched {op.name} tensor shapes: One rank sent a tensor of rank "
                f"{len(a.shape)}, but another rank sent a tensor of rank {len(b.shape)}."))
            if err:
                return err
            for d in range(1, len(first.shape)):
                err = mismatch(lambda r, d=d: r.shape[d], lambda a, b, d=d: (
                    f"Mismatched {op.name} tensor shapes: One rank sent a tensor with dimension "
                    f"{d} equal to {a.shape[d]}, but another rank sent a tensor with dimension "
                    f"{d} equal to {b.shape[d]}."))
                if err:
                    return err
        if op == RequestType.REDUCESCATTER:
            if joined:
                return self._error(name, "Reducescatter is not supported with Join at this time.")
            if len(first.shape) == 0:
                return self._error(name, (
                    "Process-set rank zero tried to REDUCESCATTER a rank-zero tensor. "
                    f"(tensor {quote_name(name)}; use a tensor with at least one dimension)"))
        if op == RequestType.BROADCAST:
            if joined:
                return self._error(name, "Broadcast is not supported with Join at this time.")
            err = mismatch(lambda r: r.root, lambda a, b: (
                f"Mismatched BROADCAST root ranks: One rank specified root rank {a.root}, but "
                f"another rank specified root rank {b.root}."))
            if err:
                return err
        err = mismatch(lambda r: "GPU" if r.device != CPU_DEVICE else "CPU", lambda a, b: (
            f"Mismatched {op.name} CPU/GPU device selection: One rank specified device "
            f"{'GPU' if a.device != CPU_DEVICE else 'CPU'}, but another rank specified device "
            f"{'GPU' if b.device != CPU_DEVICE else 'CPU'}."))
        if err:
            return err
        return self._response(name, first, reqs)

    def _response(self, name: str, first: Request, reqs: dict[int, Request]) -> Response:
        rtype = ResponseType(int(first.type))
        r = Response(type=rtype, names=[name], dtype=first.dtype,
                     device=CPU_DEVICE if first.device == CPU_DEVICE else 0,
                     reduce_op=first.reduce_op, prescale=first.prescale,
                     postscale=first.postscale, root=first.root, shapes=[first.shape])
        if rtype in (ResponseType.ALLREDUCE, ResponseType.ADASUM, ResponseType.REDUCESCATTER):
            r.sizes = [first.num_elements()]
        elif rtype == ResponseType.ALLGATHER:
            r.sizes = [reqs[k].shape[0] for k in range(self.size)]
        return r


def words_to_int(words: np.ndarray) -> int:
    """A round's bit words (uint64, word 0 lowest) as one Python int."""
    return int.from_bytes(words.astype("<u8", copy=False).tobytes(), "little")


def bit_indices(mask: int) -> list[int]:
    """The positions of the bits set in `mask`, ascending (a loop over set bits only)."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class PendingHits:
    """Requests found in the response cache, waiting until every rank has them.

    The bit set is a Python int kept up to date incrementally (int bit operations cost tens
    of nanoseconds, numpy scalar operations a microsecond), so a cycle that finds nothing new
    costs O(words), not O(pending tensors).
    """

    def __init__(self) -> None:
        self._by_bit: dict[int, tuple[Request, float]] = {}
        self._mask = 0

    def __bool__(self) -> bool:
        return bool(self._by_bit)

    def __contains__(self, bit: int) -> bool:
        return bit in self._by_bit

    def add(self, bit: int, req: Request, now: float) -> None:
        self._by_bit[bit] = (req, now)
        self._mask |= 1 << bit

    def pop(self, bit: int) -> Request:
        req, _ = self._by_bit.pop(bit)
        self._mask &= ~(1 << bit)
        return req

    def drain(self) -> list[Request]:
        reqs = [r for r, _ in self._by_bit.values()]
        self._by_bit.clear()
        self._mask = 0
        return reqs

    def older_than(self, deadline: float) -> list[int]:
        return [b for b, (_, t) in self._by_bit.items() if t < deadline]

    def vector(self, nbits: int) -> np.ndarray:
        """[status word] + hit bits for `nbits` cache bits (status word left 0)."""
        n = (nbits + 63) // 64
        out = np.zeros(1 + n, dtype=np.uint64)
        mask = self._mask & ((1 << (64 * n)) - 1)
        if mask:
            out[1:] = np.frombuffer(mask.to_bytes(8 * n, "little"), dtype="<u8")
        return out

    def take_common(self, res: np.ndarray) -> list[int]:
        """Removes and returns (ascending) the bits set in the AND result `res`."""
        if not self._mask:
            return []
        both = words_to_int(res[1:]) & self._mask
        bits = bit_indices(both)
        for b in bits:
            self.pop(b)
        return bits

    def remap(self, cache: ResponseCache) -> list[Request]:
        """Re-keys by the cache's new bit numbers; returns requests that are no longer hits."""
        items = list(self._by_bit.values())
        self._by_bit.clear()
        self._mask = 0
        lost = []
        for req, t in items:
            state, bit = cache.lookup(req)
            if state is CacheState.HIT:
                self.add(bit, req, t)
            else:
                lost.append(req)
        return lost
