"""`ProcessSetState`: one process set as this rank sees it (tensor table, queue, response
cache, message table and stall inspector), and `shutdown_error`, what its handles get when
the job ends."""
from __future__ import annotations

import itertools
import threading
from typing import Any, Mapping

import numpy as np

from .. import _log
from ..engines.device import release_ready
from ..entry import Entry
from ..errors import SHUT_DOWN_MESSAGE, HorovodInternalError, ShutdownError, StallError
from ..negotiation import CacheState, MessageTable, PendingHits, ResponseCache
from ..stall import StallInspector
from ..types import Request, RequestType

__all__ = ["ProcessSetState", "shutdown_error"]

_log_ = _log.get_logger()


class ProcessSetState:
    """One process set as this rank sees it. Fields marked (lock) are shared with user threads."""

    def __init__(self, ps_id: int, ranks: list[int], control: Any, host_engine: Any,
                 config: Any) -> None:
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
        # Set ranks that joined the global set (a set other than the global one: they wait in
        # join() and submit none of its ops); recomputed at each round's start while any rank
        # has joined (negotiate.py), the same round on every member.
        self.members_joined: frozenset[int] = frozenset()
        self.removed = False  # (lock) remove_process_set() dropped the set: submits refused
        # Registered gradient sets (collective/gradset.py), in registration order; changed
        # only inside a round, at the same point on every rank.
        self.sets: list[Any] = []
        self.set_count = 0  # registrations completed (names the next one's allgather)
        self.messages = MessageTable(self.size, ranks) if self.is_root else None
        self.stall = StallInspector(config.stall_check_time, config.stall_shutdown_time,
                                    not config.stall_check_disable,
                                    warn=_log_.warning) if self.is_root else None
        # On global rank 0 with a timeline: its event methods for this set (rows of sets other
        # than the global one carry the set, `Timeline.for_set`); else None.
        self.timeline: Any = None
        # Numbers of this set's unnamed ops (`noname.<n>`); every member counts alike.
        self.next_noname = itertools.count(1).__next__

    def pending(self) -> bool:
        return bool(self.table) or any(s.busy() for s in self.sets)

    def set_words(self) -> int:
        """Words the gradient sets add to a round's AND vector (after the cache's): each set's,
        then the flag words (`set_flags`)."""
        n = len(self.sets)
        return sum(s.nwords for s in self.sets) + flag_words(n) if n else 0

    def set_flags(self, joined: bool) -> np.ndarray:
        """The flag words of a round: bit 0, this rank has joined (set everywhere: nothing to
        reduce); bit 1 + k, set k was retired here (set everywhere: every rank drops it after
        this round). Call after the sets' `words`, which fix what a round sends."""
        flags = int(joined)
        for k, s in enumerate(self.sets):
            if s._sent_retired:
                flags |= 2 << k
        return np.frombuffer(flags.to_bytes(8 * flag_words(len(self.sets)), "little"),
                             dtype="<u8")

    def _join_request(self) -> Request | None:
        """This rank's pending join, if it has joined."""
        for e in list(self.table.values()):
            if e.request.type == RequestType.JOIN:
                return e.request
        return None

    def join_device(self) -> int:
        """The device this rank's pending join named for its zeros (`collective.join`), else
        -1 (the engine's choice)."""
        req = self._join_request()
        return -1 if req is None else req.device

    def joined_here(self) -> bool:
        """This rank has joined (its join op is pending) and contributes zeros."""
        return self._join_request() is not None

    def pop(self, name: str) -> Entry | None:
        with self.lock:
            return self.table.pop(name, None)

    def forget(self, req: Request) -> None:
        """Drops a failed entry's request from what this rank still negotiates: a pending cache
        hit, a carried request, or one still queued (coordinator thread). A grouped op's
        members can fail while some of them wait as cache hits (`MessageTable._group_mismatch`),
        and an error can name an op submitted after this round's queue was drained (a group
        member, a set's op while a rank waits in `join()`): sent later, its request would meet
        the other ranks' next op of that name without an entry here."""
        with self.lock:
            if self.queue:
                self.queue = [r for r in self.queue if r is not req]
        if self.hits:
            state, bit = self.cache.lookup(req)
            if state is CacheState.HIT and bit in self.hits:
                self.hits.pop(bit)
        if self.carry:
            self.carry = [r for r in self.carry if r is not req]

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
        for s in self.sets:
            s.fail(exc)


def shutdown_error(cause: BaseException | None, by: Mapping[int, str] | None = None
                   ) -> BaseException:
    """What pending and later ops raise once the job ended because of `cause` (None: a clean
    shutdown, which the global ranks in `by` asked for: rank -> "stall" or "shutdown")."""
    if isinstance(cause, HorovodInternalError):
        return cause
    text, cls = SHUT_DOWN_MESSAGE, ShutdownError
    if cause is None and by:
        for why, what in (("stall", "shut the job down after a stall "
                                    "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; the stall warnings "
                                    "in the log of that rank name what waited)"),
                          ("shutdown", "ended the job (hvd.shutdown(), or the end of the "
                                       "program)")):
            ranks = ", ".join(str(r) for r in sorted(by) if by[r] == why)
            if ranks:
                text += f" Rank(s) {ranks} {what}."
        if "stall" in by.values():
            cls = StallError
    err = cls(text)
    err.__cause__ = cause
    return err


def flag_words(nsets: int) -> int:
    """Flag words of a round with `nsets` gradient sets (`ProcessSetState.set_flags`)."""
    return (nsets + 64) // 64
