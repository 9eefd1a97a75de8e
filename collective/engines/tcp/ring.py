"""Host data engine of the tcp mode: ring algorithms over the plane's links.

Large ops stream in chunks of `CHUNK` bytes: each rank receives a chunk from its left
neighbour, reduces it into place (numpy, no Python loop over elements) and hands it to the
sender thread of its right link at once, so receiving, reducing and sending overlap.

* allreduce: reduce-scatter then allgather around the ring (each rank sends and receives
  2(n-1)/n of the buffer); small buffers (<= DIRECT_MAX) take one exchange at two ranks or a
  reduce at rank 0 in rank order, so every rank gets the same bits.
* reduce-scatter: the first half of the ring allreduce, ending with each rank's own block.
* allgatherv: the ring, forwarding each block as it arrives.
* broadcast: a pipelined chain from the root around the ring (a star for small buffers).
* alltoallv: n-1 pairwise steps (send to rank+k, receive from rank-k).

Each op starts with a header (op, sequence number, byte count) per link so ranks that are out
of step fail with a clear error instead of reading each other's data.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ...errors import HorovodInternalError
from ...types import ReduceOp
from ..base import HostEngine
from .link import DIRECT_MAX
from .plane import TcpControlPlane, small_allreduce

__all__ = ["TcpEngine", "CHUNK", "create_engine"]

# 512 KiB: past the point where per-chunk overhead (a queue hand-off, a note, two syscalls)
# matters, small enough for the reduce of one chunk to overlap the transfer of the next, and
# for the scratch chunk to stay in cache (256 KiB-1 MiB were within noise of each other on the
# CI box; 4 MiB was ~10% slower at 16 MiB).
CHUNK = 512 << 10

# Two ranks allreduce by exchanging whole buffers (see _allreduce_pair); False = the ring.
# Not over zero-copy links: there a post is done only once the peer read it, and both ranks
# would wait for that before reading the other's chunk.
PAIR_ALLREDUCE = True

_ADDR = struct.Struct("<QQ")  # address and size of a buffer (zero-copy allreduce)

OP_ALLREDUCE, OP_ALLREDUCE_OUT, OP_RS, OP_AG, OP_BCAST, OP_A2A = 16, 17, 18, 19, 20, 21

_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def _ranges(start: int, end: int, step: int):
    for a in range(start, end, step):
        yield a, min(a + step, end)


class TcpEngine(HostEngine):
    """Ring collectives over TCP / Unix sockets for one group."""

    name = "tcp"
    prefix = "GLOO"  # timeline activities GLOO_ALLREDUCE, ... as Horovod's Gloo ops
    reduces_float16 = True  # numpy reduces float16 natively (rounding once per step)

    def __init__(self, control: TcpControlPlane, fusion_threshold: int) -> None:
        super().__init__(control, fusion_threshold)
        self.plane = control
        self._scratch = np.empty(0, dtype=np.uint8)
        self._mesh = False  # every link of the plane is open (`_alltoallv`)

    def _tmp(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def _neighbours(self):
        n, r = self.size, self.rank
        return self.plane.link((r + 1) % n), self.plane.link((r - 1) % n)

    # -- allreduce ----------------------------------------------------------------------------
    def _allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        if self.size == 1 or buf.size == 0:
            return
        # Overflow to inf and inf - inf = nan are results here, as in MPI and NCCL, not
        # warnings from inside the engine.
        with np.errstate(over="ignore", invalid="ignore"):
            self._ring_allreduce(buf, op)

    def _ring_allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        ufunc = _REDUCE[op]
        if buf.nbytes <= DIRECT_MAX:
            small_allreduce(self.plane, buf, ufunc, OP_ALLREDUCE, OP_ALLREDUCE_OUT)
            return
        if self.size == 2:
            link = self.plane.link(1 - self.rank)
            if link.zero_copy:
                self._allreduce_in_place(buf, ufunc, link)
                return
            if PAIR_ALLREDUCE:
                self._allreduce_pair(buf, ufunc)
                return
        n, r = self.size, self.rank
        right, left = self._neighbours()
        item = buf.itemsize
        raw = buf.view(np.uint8)
        bounds = _offsets([(buf.size // n) + (1 if i < buf.size % n else 0) for i in range(n)])
        step = max(CHUNK // item, 1)
        tmp = self._tmp(step * item).view(buf.dtype)
        right.send_msg(OP_ALLREDUCE, nbytes=buf.nbytes)
        left.recv_hdr(OP_ALLREDUCE, buf.nbytes)

        def seg(i: int):
            return _ranges(bounds[i], bounds[i + 1], step)

        for a, b in seg(r):
            right.post(raw[a * item:b * item].data, direct=False)
        for s in range(n - 1):  # reduce-scatter; the last step yields block r+1, sent at once
            for a, b in seg((r - s - 1) % n):
                dst = buf[a:b]
                left.recv_reduce(dst, dst, ufunc, tmp)
                right.post(raw[a * item:b * item].data, direct=False)
        for s in range(n - 1):  # allgather: forward every block but the last one received
            for a, b in seg((r - s) % n):
                view = raw[a * item:b * item].data
                left.recv_into(view)
                if s < n - 2:
                    right.post(view, direct=False)
        right.flush()

    def _allreduce_in_place(self, buf: np.ndarray, ufunc, link) -> None:
        """Two ranks of one host that may read each other's memory (MPI's CMA path): each
        reduces one half, reading the peer's copy straight from the peer's buffer, then copies
        the peer's reduced half from it. Three small messages synchronise the whole op, so a
        rank that the scheduler delays holds the other up at most three times, not per chunk:
        "here is my buffer", "my half is reduced (and I am done reading yours)", "done"."""
        r = self.rank
        item = buf.itemsize
        half = (buf.size + 1) // 2
        mine = (0, half) if r == 0 else (half, buf.size)  # the half this rank reduces
        other = (half, buf.size) if r == 0 else (0, half)
        base = buf.ctypes.data
        link.send_msg(OP_ALLREDUCE, _ADDR.pack(base, buf.nbytes))
        peer, nbytes = _ADDR.unpack(link.recv_msg(OP_ALLREDUCE, _ADDR.size))
        if nbytes != buf.nbytes:
            raise link.fabric.fail(HorovodInternalError(
                f"ranks are out of step: rank {link.fabric.rank} allreduces {buf.nbytes} bytes, "
                f"rank {link.peer_global} {nbytes}"))
        step = max(CHUNK // item, 1)
        tmp = self._tmp(step * item).view(buf.dtype)
        for a, b in _ranges(mine[0], mine[1], step):
            link.read_peer(tmp.ctypes.data, peer + a * item, (b - a) * item)
            dst = buf[a:b]
            ufunc(dst, tmp[:b - a], out=dst)
        link.send_msg(OP_ALLREDUCE_OUT)  # my half is final; I no longer read yours
        link.recv_msg(OP_ALLREDUCE_OUT, 0)
        a, b = other
        if b > a:
            link.read_peer(base + a * item, peer + a * item, (b - a) * item)
        link.send_msg(OP_ALLREDUCE)  # done reading: the peer may return and reuse its buffer
        link.recv_msg(OP_ALLREDUCE, 0)

    def _allreduce_pair(self, buf: np.ndarray, ufunc) -> None:
        """Two ranks: both stream their whole buffer and reduce the other's into their own.
        The same bytes per rank as the ring, but no allgather phase, so a rank waits for its
        peer once per chunk instead of through a two-hop chain (which matters when the ranks
        compete with other processes for the cores). Commutative ops: identical bits."""
        link = self.plane.link(1 - self.rank)
        item = buf.itemsize
        raw = buf.view(np.uint8)
        step = max(CHUNK // item, 1)
        tmp = self._tmp(step * item).view(buf.dtype)
        link.send_msg(OP_ALLREDUCE, nbytes=buf.nbytes)
        link.recv_hdr(OP_ALLREDUCE, buf.nbytes)
        chunks = list(_ranges(0, buf.size, step))
        tickets = [link.post(raw[a * item:b * item].data, direct=False)
                   for a, b in chunks]
        ring = link.holds_a_chunk and not link.zero_copy
        for (a, b), ticket in zip(chunks, tickets):
            dst = buf[a:b]
            if ring:  # our chunk leaves into the ring whatever the peer does: reduce in place
                link.wait_sent(ticket)  # our copy of this chunk left before we overwrite it
                link.recv_reduce(dst, dst, ufunc, tmp)
                continue
            # A socket may buffer less than a chunk: waiting for ours to leave before reading
            # the peer's would deadlock both ranks (each sender blocked on a peer that does not
            # read). The peer's chunk first, into `tmp`.
            t = tmp[:b - a]
            link.recv_into(t.view(np.uint8).data)
            link.wait_sent(ticket)
            ufunc(dst, t, out=dst)
        link.flush()

    # -- reduce-scatter -----------------------------------------------------------------------
    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                        op: ReduceOp) -> None:
        """Ring reduce-scatter; reduces in place in `send` (a scratch buffer of the caller)."""
        if self.size == 1:
            recv[...] = send[:counts[0]]
            return
        with np.errstate(over="ignore", invalid="ignore"):  # as in _allreduce
            self._ring_reduce_scatter(send, recv, counts, op)

    def _ring_reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                             op: ReduceOp) -> None:
        n, r = self.size, self.rank
        bounds = _offsets(counts)
        ufunc = _REDUCE[op]
        item = send.itemsize
        raw = send.view(np.uint8)
        direct = send.nbytes <= DIRECT_MAX
        step = max(CHUNK // item, 1)
        tmp = self._tmp(step * item).view(send.dtype)
        right, left = self._neighbours()
        right.send_msg(OP_RS, nbytes=send.nbytes)
        left.recv_hdr(OP_RS, send.nbytes)
        first = (r - 1) % n
        for a, b in _ranges(bounds[first], bounds[first + 1], step):
            right.post(raw[a * item:b * item].data, direct=direct)
        mine = bounds[r]
        for s in range(n - 1):
            blk = (r - s - 2) % n
            last = s == n - 2
            for a, b in _ranges(bounds[blk], bounds[blk + 1], step):
                if last:
                    left.recv_reduce(send[a:b], recv[a - mine:b - mine], ufunc, tmp)
                else:
                    dst = send[a:b]
                    left.recv_reduce(dst, dst, ufunc, tmp)
                    right.post(raw[a * item:b * item].data, direct=direct)
        right.flush()

    # -- allgather ----------------------------------------------------------------------------
    def _allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        n, r = self.size, self.rank
        offs = _offsets(counts)
        mine = recv[offs[r]:offs[r + 1]]
        if mine.nbytes and not np.shares_memory(mine, send):
            mine[...] = send[:counts[r]]
        if n == 1:
            return
        total = offs[-1]
        direct = total <= DIRECT_MAX
        right, left = self._neighbours()
        right.send_msg(OP_AG, nbytes=total)
        left.recv_hdr(OP_AG, total)
        for a, b in _ranges(offs[r], offs[r + 1], CHUNK):
            right.post(recv[a:b].data, direct=direct)
        for s in range(n - 1):
            blk = (r - s - 1) % n
            for a, b in _ranges(offs[blk], offs[blk + 1], CHUNK):
                view = recv[a:b].data
                left.recv_into(view)
                if s < n - 2:
                    right.post(view, direct=direct)
        right.flush()

    # -- broadcast ----------------------------------------------------------------------------
    def _broadcast(self, buf: np.ndarray, root: int) -> None:
        n, r = self.size, self.rank
        if n == 1:
            return
        nb = buf.nbytes
        raw = buf.data
        if nb <= DIRECT_MAX and n > 2:  # one hop from the root to each rank
            if r == root:
                links = [self.plane.link(p) for p in range(n) if p != root]
                for link in links:
                    link.send_msg(OP_BCAST, raw)
                for link in links:
                    link.flush()
            else:
                self.plane.link(root).recv_msg(OP_BCAST, nb, into=raw)
            return
        pos = (r - root) % n
        right, left = self._neighbours()
        direct = nb <= DIRECT_MAX
        if pos < n - 1:
            right.send_msg(OP_BCAST, nbytes=nb)
        if pos:
            left.recv_hdr(OP_BCAST, nb)
        for a, b in _ranges(0, nb, CHUNK):
            if pos:
                left.recv_into(raw[a:b])
            if pos < n - 1:
                right.post(raw[a:b], direct=direct)
        if pos < n - 1:
            right.flush()

    # -- alltoall -----------------------------------------------------------------------------
    def _alltoallv(self, send: np.ndarray, sendcounts: list[int], recv: np.ndarray,
                   recvcounts: list[int]) -> None:
        n, r = self.size, self.rank
        soff, roff = _offsets(sendcounts), _offsets(recvcounts)
        recv[roff[r]:roff[r + 1]] = send[soff[r]:soff[r + 1]]
        if not self._mesh:
            # Every link, opened in ascending peer order on every rank (the pairs in one
            # global order): opened in the loop's order below, ranks k apart wait for each
            # other in cycles (from 6 ranks of a host, whose links exchange a hello).
            for p in range(n):
                if p != r:
                    self.plane.link(p)
            self._mesh = True
        used = []
        for k in range(1, n):
            dst, src = (r + k) % n, (r - k) % n
            out, inp = self.plane.link(dst), self.plane.link(src)
            nb_out, nb_in = sendcounts[dst], recvcounts[src]
            out.send_msg(OP_A2A, nbytes=nb_out)
            for a, b in _ranges(soff[dst], soff[dst + 1], CHUNK):
                out.post(send[a:b].data, direct=nb_out <= DIRECT_MAX)
            inp.recv_hdr(OP_A2A, nb_in)
            if nb_in:
                inp.recv_into(recv[roff[src]:roff[src + 1]].data)
            used.append(out)
        for link in used:
            link.flush()

    def _barrier(self) -> None:
        self.plane.barrier()

    def abort(self) -> None:
        self.plane.abort("engine aborted")


def create_engine(control: Any, config: Any) -> Any:
    """The host engine of the tcp mode for one group's plane.

    Raises:
        TypeError: `control` is not a tcp plane.
    """
    if not isinstance(control, TcpControlPlane):
        raise TypeError(f"the tcp engine needs a tcp control plane, got {type(control).__name__}")
    return TcpEngine(control, config.fusion_threshold)
