"""`Link`: one authenticated connection of a plane to one peer.

Two kinds of bytes travel on a link: *raw* ones (headers and small messages, written straight
to the socket) and *stream* ones (bulk payload handed to `post`: on the socket here, through
shared memory in `shm.ShmLink`). Both leave in the order they were handed over: when
anything is queued for the link's sender thread, raw sends queue behind it.

Only the coordinator thread calls a link, plus the link's own sender thread
(`hvd-tcp-send-<plane>-<peer>`), started on the first bulk send.
"""
from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from ...errors import CollectiveTimeoutError, HorovodInternalError
from .net import Fabric

__all__ = ["Link", "DIRECT_MAX", "HDR_SIZE", "SMALL_SPIN", "BULK_SPIN"]

# Sends up to this size go straight from the calling thread: far below any socket buffer, so
# two ranks sending to each other before receiving cannot block each other.
DIRECT_MAX = 64 << 10
# How long (seconds) a receive polls (yielding the CPU) before it blocks: for headers and
# small messages, and for the chunks of bulk transfers. MPI polls all the time, and waking a
# blocked thread costs tens of microseconds on an idle host (hundreds on the loaded 2-core CI
# box). Idle coordinators still exchange a bit vector every cycle, so the poll is short, and
# a link whose last wait outlasted it blocks at once next time: a slow peer costs no CPU (idle
# tcp-mode ranks use ~7% of a core, idle MPI-mode ranks ~30%). On the CI box, polls of 0.1 to
# 5 ms made no measurable difference to small ops (their latency is set by where the
# scheduler puts the coordinator threads: HOROVOD_THREAD_AFFINITY=0,1 cut it to a third in
# benchmarks/tcp_allreduce.py), and polling for bulk chunks made 1-16 MiB allreduces slower
# when the ranks shared the cores with other work, so bulk receives block at once.
SMALL_SPIN = 100e-6
BULK_SPIN = 0.0
_HDR = struct.Struct("<IIQ")  # opcode, sequence number, payload bytes
HDR_SIZE = _HDR.size


class Link:
    """A connection to one peer of one plane. Only the coordinator thread calls it (plus the
    link's own sender thread)."""

    zero_copy = False  # True: a post is done only when the peer has read it (shm.py, CMA)
    # True: a posted chunk (ring.CHUNK) leaves the caller's memory whether or not the peer
    # reads (shm.py's rings); a socket's buffer may hold less.
    holds_a_chunk = False

    def __init__(self, fabric: Fabric, sock: socket.socket, peer: int, peer_global: int,
                 plane: str) -> None:
        self.fabric, self.sock = fabric, sock
        self.peer, self.peer_global, self.plane = peer, peer_global, plane
        sock.settimeout(fabric.timeout if fabric.timeout > 0 else 1e9)
        # A non-blocking twin on the same connection for spinning reads (a socket with a
        # timeout always polls before it reads, even with MSG_DONTWAIT).
        self._nb = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
        self._nb.setblocking(False)
        self._spin_ok = True  # the last wait on this link was short: poll first next time
        self._send_seq = self._recv_seq = 0
        self._hdr = bytearray(HDR_SIZE)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # queued items not yet sent
        self._queued = 0  # items ever queued (a post's ticket)
        self._sent = 0  # items ever sent by the sender thread
        self._cv = threading.Condition(threading.Lock())
        self._send_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        fabric.register(self)

    def __repr__(self) -> str:
        return f"<Link {self.plane} -> rank {self.peer_global}>"

    # -- errors -------------------------------------------------------------------------------
    def _error(self, exc: BaseException | None, doing: str) -> BaseException:
        f = self.fabric
        if f.error is not None:
            return f.fail(f.error)
        me, peer = f.rank, self.peer_global
        where = f.describe(peer)
        if isinstance(exc, (socket.timeout, TimeoutError)):
            err: BaseException = CollectiveTimeoutError(
                f"rank {me} timed out after {f.timeout:.0f} s {doing} rank {peer} ({where}). "
                "That rank is hung, stopped or far behind; check its log, or raise "
                "HOROVOD_GLOO_TIMEOUT_SECONDS (hvdrun --gloo-timeout-seconds) if it is only slow.")
        else:
            err = HorovodInternalError(
                f"rank {me} lost its connection to rank {peer} ({where}) while {doing} it "
                f"({exc or 'connection closed'}). Rank {peer} died, or failed and closed its "
                "connections (then its log names the first failure).")
        return f.fail(err)

    # -- sending ----------------------------------------------------------------------------
    # Two kinds of bytes travel on a link: "raw" (headers and small messages, always on the
    # socket) and "stream" (bulk payload handed to `post`; on the socket here, through shared
    # memory in `shm.ShmLink`). Both kinds leave in the order they were handed over.
    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Sends raw bytes now from the calling thread (queued behind earlier posts)."""
        if self._pending:
            self._enqueue(memoryview(data), True)
            return
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self._error(exc, "sending to") from exc

    def send_msg(self, op: int, payload: bytes | bytearray | memoryview = b"",
                 nbytes: int | None = None) -> None:
        """A header (op, sequence, length), then the payload: raw when it is at most DIRECT_MAX
        bytes, else streamed. With `nbytes`, only the header; the caller posts the payload."""
        n = len(payload) if nbytes is None else nbytes
        hdr = _HDR.pack(op, self._send_seq & 0xFFFFFFFF, n)
        self._send_seq += 1
        if nbytes is None and n <= DIRECT_MAX:
            self.send(hdr + bytes(payload) if n else hdr)
        else:
            self.send(hdr)
            if nbytes is None:
                self.post(memoryview(payload).cast("B"), direct=False)

    def post(self, view: memoryview, direct: bool = True) -> int:
        """Streams `view`: from the sender thread, or with `direct`, now, when it is small and
        nothing is queued. Queued memory must stay untouched until `flush()` or
        `wait_sent(ticket)`.

        Streaming ops of more than DIRECT_MAX bytes pass direct=False: a rank blocked in a
        direct send cannot receive, and a ring of such ranks could fill every buffer.

        Returns:
            A ticket for `wait_sent` (0 when `view` already left).
        """
        if direct and not self._pending and view.nbytes <= DIRECT_MAX and self._direct(view):
            return 0
        return self._enqueue(view, False)

    def wait_sent(self, ticket: int) -> None:
        """Waits until the post with this ticket left the caller's memory.

        Raises:
            HorovodInternalError, CollectiveTimeoutError: a send failed.
        """
        if self._sent < ticket:
            with self._cv:
                while self._sent < ticket and self._send_error is None:
                    self._cv.wait()
        if self._send_error is not None:
            raise self._error(self._send_error, "sending to")

    def _direct(self, view: memoryview) -> bool:
        """Sends a small stream piece from the calling thread; False = queue it instead."""
        try:
            self.sock.sendall(view)
        except OSError as exc:
            raise self._error(exc, "sending to") from exc
        return True

    def _enqueue(self, view: memoryview, raw: bool) -> int:
        if self._send_error is not None:
            raise self._error(self._send_error, "sending to")
        with self._cv:
            self._pending += 1
            self._queued += 1
            ticket = self._queued
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._sender, name=f"hvd-tcp-send-{self.plane}-{self.peer_global}",
                daemon=True)
            self._thread.start()
        self._q.put((raw, view))
        return ticket

    def _emit(self, raw: bool, view: memoryview) -> None:
        """Sender thread: puts one queued item on the wire."""
        self.sock.sendall(view)

    def _sender(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._send_error is None:
                try:
                    self._emit(*item)
                except OSError as exc:
                    self._send_error = exc
                    if not self._closing:
                        self._error(exc, "sending to")  # records it and wakes the receiver
                except BaseException as exc:  # noqa: BLE001 - e.g. a failure raised by _emit
                    self._send_error = exc
            with self._cv:
                self._pending -= 1
                self._sent += 1
                self._cv.notify_all()

    def flush(self) -> None:
        """Waits until every queued send left (the socket timeout bounds each send).

        Raises:
            HorovodInternalError, CollectiveTimeoutError: a send failed.
        """
        if self._pending:
            with self._cv:
                while self._pending:
                    self._cv.wait()
        if self._send_error is not None:
            raise self._error(self._send_error, "sending to")

    # -- receiving ----------------------------------------------------------------------------
    def recv_raw(self, view: memoryview, bulk: bool = False) -> None:
        """Fills `view` (bytes) from the socket.

        Raises:
            HorovodInternalError: the peer closed the connection or the fabric failed.
            CollectiveTimeoutError: nothing arrived for the fabric's timeout.
        """
        n = view.nbytes
        got = 0
        sock = self.sock
        try:
            spin = BULK_SPIN if bulk else SMALL_SPIN
            if spin > 0 and self._spin_ok:
                got = self._spin_recv(view, spin)
                if got == n:
                    return
            t0 = time.perf_counter()
            while got < n:
                r = sock.recv_into(view[got:] if got else view, n - got)
                if r == 0:
                    raise self._error(None, "receiving from")
                got += r
            if spin > 0:
                self._spin_ok = time.perf_counter() - t0 < 2 * spin
        except OSError as exc:
            raise self._error(exc, "receiving from") from exc

    def _spin_recv(self, view: memoryview, spin: float) -> int:
        """Polls without blocking for up to `spin` seconds, yielding the CPU between tries;
        returns the bytes read."""
        n, got = view.nbytes, 0
        nb = self._nb
        end = time.perf_counter() + spin
        while got < n:
            try:
                r = nb.recv_into(view[got:] if got else view, n - got)
            except BlockingIOError:
                if time.perf_counter() > end:
                    return got
                os.sched_yield()
                continue
            if r == 0:
                raise self._error(None, "receiving from")
            got += r
        return got

    def recv_into(self, view: memoryview) -> None:
        """Fills `view` (bytes) with stream data (what the peer `post`ed)."""
        self.recv_raw(view, bulk=view.nbytes > DIRECT_MAX)

    def recv_reduce(self, a: np.ndarray, out: np.ndarray, ufunc: Any, tmp: np.ndarray) -> None:
        """Receives `a.size` streamed elements x and sets ``out = ufunc(a, x)``; `tmp` is a
        scratch array of a's dtype and at least its size."""
        t = tmp[:a.size]
        self.recv_into(t.view(np.uint8).data)
        ufunc(a, t, out=out)

    def recv_msg(self, op: int, nbytes: int | None = None,
                 into: memoryview | None = None) -> memoryview:
        """Receives a header (checked against `op`, and `nbytes` when given) and its payload,
        into `into` when given, else into a new buffer; returns the payload's view.

        Raises:
            HorovodInternalError: the peer sent another op or size (ranks out of step).
        """
        if nbytes is not None and into is None and nbytes <= DIRECT_MAX:
            buf = bytearray(HDR_SIZE + nbytes)  # header and payload in one read
            mv = memoryview(buf)
            self.recv_raw(mv)
            self._check(op, nbytes, buf)
            return mv[HDR_SIZE:]
        hv = memoryview(self._hdr)
        self.recv_raw(hv)
        n = self._check(op, nbytes, self._hdr)
        if into is None:
            into = memoryview(bytearray(n))
        if n <= DIRECT_MAX:
            self.recv_raw(into[:n])
        else:
            self.recv_into(into[:n])
        return into[:n]

    def recv_hdr(self, op: int, nbytes: int) -> None:
        hv = memoryview(self._hdr)
        self.recv_raw(hv)
        self._check(op, nbytes, self._hdr)

    def _check(self, op: int, nbytes: int | None, hdr: bytes | bytearray) -> int:
        rop, seq, n = _HDR.unpack_from(hdr)
        want_seq = self._recv_seq & 0xFFFFFFFF
        self._recv_seq += 1
        if rop != op or seq != want_seq or (nbytes is not None and n != nbytes):
            f = self.fabric
            raise f.fail(HorovodInternalError(
                f"ranks are out of step on plane {self.plane}: rank {f.rank} expected op {op} "
                f"#{want_seq} ({nbytes} bytes) from rank {self.peer_global}, which sent op "
                f"{rop} #{seq} ({n} bytes). Every rank of a process set must run the same "
                "collectives in the same order with the same sizes."))
        return n

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        self._closing = True
        if self._thread is not None:
            self._q.put(None)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._thread.join()
            self._thread = None
        self._nb.close()
        self.sock.close()
        self.fabric.unregister(self)
