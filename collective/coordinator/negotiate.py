"""Negotiation rounds: which requests are ready on every rank of a process set.

A round drains the set's queue, looks each request up in the response cache and contributes one
word vector to a bitwise-AND allreduce: four inverted status bits (shutdown, uncached work,
invalid entry, autotune parameters to switch to: tuning.py), one bit per cached response this
rank has a request for (autotune may switch the cache off and on between rounds: tuning.py)
and, after those, one bit per member of each registered gradient set (collective/gradset.py).
Bits set everywhere are ready on every rank; a gradient set's agreed members become
`SetChunk`s, run after the round's responses. If any rank has uncached work, the slow path
gathers the uncached requests at the set's rank 0, whose message table validates and orders
them, fuses the ready responses (`fusion.plan_fusion`) and broadcasts the list; every rank then
updates its cache the same way. The message encoding is `collective.negotiation`'s.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import _log
from ..fusion import plan_fusion
from ..negotiation import (CACHEABLE, EVICTION_WARNING, CacheState, bit_indices,
                           decode_gathered, decode_responses, encode_requests, encode_responses,
                           words_to_int)
from ..types import Request, RequestType, Response, ResponseType
from .state import ProcessSetState, flag_words
from .tuning import Tuning

__all__ = ["Negotiator", "check_stall", "ALL_CLEAR", "NOT_RETUNE"]

_log_ = _log.get_logger()

# Status bits of the fast-path vector, stored inverted (set = condition false), as Horovod.
# NOT_RETUNE: cleared by global rank 0 when autotune has new parameters to broadcast.
_NOT_SHUTDOWN, _NOT_UNCACHED, _NOT_INVALID, NOT_RETUNE = 1, 2, 4, 8
ALL_CLEAR = _NOT_SHUTDOWN | _NOT_UNCACHED | _NOT_INVALID | NOT_RETUNE


class Negotiator:
    """Runs negotiation rounds for the coordinator (whichever thread runs the cycle). `tl` is
    the set's timeline (`ProcessSetState.timeline`: global rank 0 only), else None; `tuning` the
    fusion threshold in force and autotune's switches."""

    def __init__(self, config: Any, tuning: Tuning) -> None:
        self.config = config
        self.tuning = tuning
        self._warned_eviction = False
        # Global ranks that have joined, as global rank 0's last slow-path round of the global
        # set said (empty when no join is active); other sets' rounds read it (`_note_joined`).
        self.joined: frozenset[int] = frozenset()
        # The global ranks that asked for the shutdown the job's last round agreed on, and why:
        # "stall" (this rank's stall check ended the job) or "shutdown" (hvd.shutdown(), the end
        # of a program). The others' ShutdownError names them.
        self.stall_shutdown = False  # set by the coordinator when its stall check ends the job
        self.shutdown_ranks: dict[int, str] = {}

    def round(self, ps: ProcessSetState, tl: Any,
              want_shutdown: bool) -> tuple[list[Response], bool]:
        """One round for `ps`: (responses to execute in order, whether the job shuts down)."""
        now = time.monotonic()
        if ps.id != 0:
            if ps.cache.capacity != self.tuning.cache_capacity:
                self.tuning.sync_cache(ps)  # autotune switched the cache in a global round
            if self.joined or ps.members_joined:
                _note_joined(ps, self.joined)
        sets = ps.sets
        joined = False
        if sets:
            # Another set's members that wait in the global join() send all bits too, so that
            # what the others submitted shows and fails (`GradientSet.fail_joined`).
            joined = ps.join_active and (ps.rank in ps.members_joined if ps.id != 0
                                         else ps.joined_here())
            for s in sets:
                s.take(now, tl)
        new = ps.drain()
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
        if hits:
            # Hits waiting for other ranks go to the slow path after a tenth of the stall
            # warning time (at most 1 s; 1 s with the stall check off): there rank 0's stall
            # inspector sees them (the warning comes at most that much after the setting), and
            # its message table meets them with another rank's members of the same grouped op
            # passed another number of tensors (other names, never a cache hit: a mismatch).
            limit = self.config.stall_check_time
            age = 1.0 if self.config.stall_check_disable or limit <= 0 else min(limit / 10, 1.0)
            for bit in hits.older_than(now - age):
                uncached.append(hits.pop(bit))
                invalid.add(bit)
        words = hits.vector(ps.cache.num_bits if cache_on else 0)
        status = 0
        if not want_shutdown:
            status |= _NOT_SHUTDOWN
        if not uncached and (cache_on or not ps.members_joined or not _doomed(ps)):
            status |= _NOT_UNCACHED  # (rank 0 of a set with doomed ops: the slow path fails them)
        if not invalid:
            status |= _NOT_INVALID
        if not self.tuning.wants_retune(ps):
            status |= NOT_RETUNE
        words[0] = status
        if sets:
            words = np.concatenate([words] + [s.words(joined) for s in sets]
                                   + [ps.set_flags(joined)])
        res = ps.control.allreduce_words(words, "and")
        return self.conclude(ps, res, uncached, invalid, want_shutdown, tl, joined)

    def conclude(self, ps: ProcessSetState, res: np.ndarray, uncached: list[Request],
                 invalid: set[int], want_shutdown: bool, tl: Any,
                 joined: bool = False) -> tuple[list[Any], bool]:
        """The rest of a negotiation round once the AND of the status words (`res`) is known:
        the agreed cache hits, the slow path if any rank sent uncached requests, and the
        gradient sets' agreed members (`SetChunk`s, after the responses; `joined`: this rank
        contributes zeros to them)."""
        set_res = None
        nset = ps.set_words()
        if nset:
            res, set_res = res[:len(res) - nset], res[len(res) - nset:]
        hits = ps.hits
        flags = int(res[0])
        any_shutdown = not flags & _NOT_SHUTDOWN
        any_uncached = not flags & _NOT_UNCACHED
        if any_shutdown and ps.id == 0:
            # The job's last round, on every rank: one byte each says who asked to end it.
            mine = (b"s" if self.stall_shutdown else b"1") if want_shutdown else b"0"
            asked = ps.control.allgather(mine)
            self.shutdown_ranks = {ps.ranks[r]: "stall" if b == b"s" else "shutdown"
                                   for r, b in enumerate(asked) if b in (b"s", b"1")}
        if not flags & _NOT_INVALID:
            inv = np.zeros_like(res)
            for bit in invalid:
                inv[1 + bit // 64] |= np.uint64(1 << (bit % 64))
            inv = ps.control.allreduce_words(inv, "or")
            for bit in _bits(inv):
                ps.cache.erase(bit)
                if bit in hits:
                    uncached.append(hits.pop(bit))
        retune = not flags & NOT_RETUNE
        if retune:  # autotune: every rank switches before this round's plan
            self.tuning.retune(ps)
        common = hits.take_common(res)
        if tl is not None:
            for b in common:
                tl.negotiate_end(ps.cache.name_of(b))
        threshold = self.tuning.fusion_threshold
        if not any_uncached:
            cached = [ps.cache.get(b) for b in common]
            out = self.fuse(ps, cached, threshold), any_shutdown
        else:
            out = self._slow_path(ps, uncached, common, want_shutdown, any_shutdown, threshold,
                                  tl)
        if retune:  # a cache switch applies from the next round (tuning.py)
            self.tuning.sync_cache(ps)
        if set_res is not None:
            out = (out[0] + self._agree_sets(ps, set_res, joined, threshold, tl), out[1])
        return out

    def _agree_sets(self, ps: ProcessSetState, res: np.ndarray, joined: bool, threshold: int,
                    tl: Any) -> list[Any]:
        chunks: list[Any] = []
        sets = ps.sets
        nflag = flag_words(len(sets))
        flags = words_to_int(res[len(res) - nflag:])
        if not flags & 1:  # some rank has gradients to reduce (not every rank joined)
            pos = 0
            for s in sets:
                words = res[pos:pos + s.nwords]
                pos += s.nwords
                if ps.members_joined:  # another set, members in the global join()
                    failed = s.fail_joined(words, joined, ps)
                    if failed is not None:
                        if tl is not None:
                            for i in failed:
                                tl.negotiate_end(s.names[i])
                        continue
                agreed = s.agree(words, joined, threshold)
                if tl is not None:
                    for c in agreed:
                        for i in c.indices:
                            if c.own >> i & 1:  # not a joined rank's zeros
                                tl.negotiate_end(s.names[i])
                chunks += agreed
        if flags >> 1:  # sets retired on every rank leave the rounds, on every rank alike
            keep = []
            for k, s in enumerate(sets):
                if flags >> (k + 1) & 1:
                    s.drop(tl)  # retired after this round's take: nothing else would release
                else:
                    keep.append(s)
            ps.sets = keep
        return chunks

    def _slow_path(self, ps: ProcessSetState, uncached: list[Request], common: list[int],
                   want_shutdown: bool, any_shutdown: bool, threshold: int,
                   tl: Any) -> tuple[list[Response], bool]:
        gathered = ps.control.gather(encode_requests(uncached, want_shutdown))
        payload = None
        if ps.is_root:
            assert gathered is not None and ps.messages is not None
            lists = decode_gathered(gathered, ps.ranks)
            constructed = ps.messages.process(
                lists,
                on_first=(lambda n, t: tl.negotiate_start(n, t.name)) if tl else None,
                on_rank=(lambda n, r: tl.negotiate_rank_ready(n, r)) if tl else None)
            if ps.members_joined:  # ops that wait for a rank blocked in the global join()
                constructed += ps.messages.fail_waiting_for(ps.members_joined, ps.id)
            if tl is not None:
                for r in constructed:
                    for n in r.names:
                        tl.negotiate_end(n)
            responses = [ps.cache.peek(b) for b in common] + constructed
            fused = self.fuse(ps, responses, threshold)
            # Keep the cache suspended through the cycle that completes a join: its responses
            # ran with zeros on joined ranks, which have no entries to cache.
            # Another set keeps it suspended while a member has joined the global set.
            join_flag = ps.messages.join_active or bool(ps.members_joined) or any(
                r.type == ResponseType.JOIN for r in constructed)
            payload = encode_responses(fused, any_shutdown, join_flag,
                                       sorted(ps.messages.joined)
                                       if join_flag and ps.id == 0 else ())
        fused, shutdown, join_active, joined = decode_responses(ps.control.bcast(payload))
        ps.join_active = join_active
        if ps.id == 0:
            if join_active:
                self.tuning.on_join(ps)  # autotune holds the bucket size from the first join
            if joined or self.joined:
                self.joined = frozenset(joined)
        elif ps.rank in ps.members_joined:
            _report_to_joined(ps, fused)
        if ps.cache.capacity > 0 and not join_active:
            for resp in fused:
                if resp.type not in CACHEABLE:
                    continue
                for single in resp.split():
                    entry = ps.table.get(single.names[0])
                    if entry is not None and ps.cache.put(single, entry.request) and (
                            not self._warned_eviction):
                        self._warned_eviction = True
                        _log_.warning(EVICTION_WARNING.format(capacity=ps.cache.capacity))
            ps.cache.renumber()
            ps.carry.extend(ps.hits.remap(ps.cache))  # bit numbers changed
        return fused, shutdown

    def fuse(self, ps: ProcessSetState, responses: list[Response],
             threshold: int) -> list[Response]:
        if len(responses) <= 1:
            return responses
        return plan_fusion(responses, threshold, ps.size,
                           disable_group_fusion=self.config.disable_group_fusion)


def check_stall(ps: ProcessSetState) -> bool:
    """On a set's rank 0 when its stall check is due: reports requests that some ranks have
    not submitted; True when the job should shut down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."""
    if ps.stall is None or not ps.stall.due() or ps.messages is None:
        return False
    report, stop = ps.stall.check(ps.messages.pending(), ps.size, ps.ranks,
                                  ps.messages.joined)
    if report:
        (_log_.error if stop else _log_.warning)(report)
    return stop


def _note_joined(ps: ProcessSetState, joined: frozenset[int]) -> None:
    """At the start of a round of a set other than the global one, while some rank has joined
    the global set (`joined`, global ranks) or had at the last round: the set's members among
    them (`members_joined`, set ranks). They wait in `join()` and will submit none of the set's
    ops, so while there are any the set's response cache is suspended (every request goes to
    its rank 0, whose slow path fails the ops that wait for them: `_doomed`). Every member
    learns `joined` in the same global round, before the same round of this set."""
    members = frozenset(i for i, r in enumerate(ps.ranks) if r in joined)
    ps.members_joined = members
    ps.join_active = bool(members)


def _doomed(ps: ProcessSetState) -> bool:
    """On a set's rank 0: some pending op waits for a member that joined the global set."""
    return ps.is_root and ps.messages is not None and ps.messages.waits_for(ps.members_joined)


def _report_to_joined(ps: ProcessSetState, responses: list[Response]) -> None:
    """On a member that waits in the global `join()`: logs the errors of ops of this set that it
    never submitted (the other members get them as exceptions; its join goes on)."""
    for r in responses:
        if r.type == ResponseType.ERROR and all(ps.table.get(n) is None for n in r.names):
            _log_.error("Rank %d waits in hvd.join() while other ranks of process set %d ran "
                        "ops that include it; they fail there: %s", ps.ranks[ps.rank], ps.id,
                        r.error)


def _bits(words: np.ndarray) -> list[int]:
    return bit_indices(words_to_int(words[1:]))
