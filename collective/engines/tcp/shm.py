"""Shared-memory streams between ranks of one host (an accelerated `Link`).

Why: between ranks of one host, streaming through a Unix socket or loopback TCP copies every
byte twice through the kernel and falls well behind Open MPI's shared memory; copying through a
shared ring instead halves the copies and matches MPI (`benchmarks/tcp_allreduce.py` measures
tcp mode against MPI mode).

Set-up, right after the authenticated Unix-socket connection is made: each end creates a
`memfd` ring of `RING` bytes that it alone writes, and passes the descriptor to the other end
over the socket (SCM_RIGHTS); the lower rank also passes one end of a socketpair, the credit
channel. No name exists in /dev/shm, nothing outlives the two processes, and only a process
that passed the handshake ever receives a descriptor.

Streaming: `post` copies the data into the ring as records (at most `MAX_RECORD` bytes, at
64-byte aligned offsets, never wrapping) and sends a 16-byte note (offset, length) on the link
socket, in order with the raw messages. The receiver reads the note, consumes the record
(copying it out, or reducing straight from the ring with numpy: one copy less than sockets),
publishes how many bytes it released in a shared counter and sends a wake-up byte on the
credit channel. A sender short of space (its sender thread; small pieces go inline only when
space is free) waits for that byte, so nobody spins: every wait blocks in the kernel with
the fabric's timeout.

A dead peer shows up as EOF on the link socket or on the credit channel, like any link.

Reading in place (`cma`): each end announces its pid and a token in its memory; the other end
reads the token with `process_vm_readv` and, if both can, stream data is read from the
sender's buffers at the addresses its notes give. The reads go to the pid the kernel reports
at the other end of the Unix socket (SO_PEERCRED), not to the one the peer announces, so a
peer can only point them at its own memory, never at another process of the user; where the
token is not found there (or the kernel reports pid 0: the peer runs in a pid namespace this
one cannot see) the link streams through the rings instead. Only Unix-socket links are set up here: a link over TCP, loopback
included, is a plain socket `Link`, which never reads a peer's memory, so no pid needs pinning
there (TCP has no SO_PEERCRED; the owner of a loopback connection could only be guessed from
/proc, racily).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import select
import socket
import struct
from typing import Any

import numpy as np

from ..._log import get_logger
from ...auth import recv_exact
from ...errors import HorovodInternalError
from . import cma
from .link import Link
from .net import Fabric

__all__ = ["ShmLink", "make_link", "RING", "MAX_RECORD"]

RING = 8 << 20
MAX_RECORD = 1 << 20
_ALIGN = 64
_CTL = 4096  # after the ring: the writer's count of bytes it released of the peer's ring
_NOTE = struct.Struct("<QQ")
_HELLO = struct.Struct("<cQQ16s")  # Y/N, pid, address of the token, token
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

# Copy into the ring from the posting thread while space is free (see ShmLink.post).
INLINE = True
# Read the peer's buffers directly (process_vm_readv) where the kernel allows it.
CMA = cma.available()
# Tests and benchmarks switch shared memory off to measure the socket path.
ENABLED = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def make_link(fabric: Fabric, sock: socket.socket, peer: int, peer_global: int,
              plane: str) -> Link:
    """A `ShmLink` when `sock` is a Unix socket and both ends can share memory, else a `Link`.

    Both ends call this on the new connection before any other traffic, and agree: each sends
    one byte (Y/N) with its descriptors, then reads the other's.

    Raises:
        HorovodInternalError: the set-up exchange failed.
    """
    if sock.family != socket.AF_UNIX:
        return Link(fabric, sock, peer, peer_global, plane)
    sock.settimeout(fabric.timeout if fabric.timeout > 0 else None)
    lower = fabric.rank < peer_global
    out_fd, pair, out_map = -1, None, None
    if ENABLED:
        try:
            out_fd = os.memfd_create("ringvod-ring", os.MFD_CLOEXEC)
            os.ftruncate(out_fd, RING + _CTL)
            out_map = mmap.mmap(out_fd, RING + _CTL)
            if lower:
                pair = socket.socketpair()
        except OSError:  # no memfd (old kernel, seccomp): plain Unix socket
            _close(out_fd, pair, out_map)
            out_fd, pair, out_map = -1, None, None
    in_fds: list[int] = []
    # Our hello: Y/N, then our pid and a token in our memory, which the peer reads with
    # process_vm_readv to find out whether it may read our buffers directly (cma.py).
    token = ctypes.create_string_buffer(os.urandom(16), 16)
    hello = _HELLO.pack(b"Y" if out_map is not None else b"N", os.getpid(),
                        ctypes.addressof(token), token.raw)
    try:
        if out_map is not None:
            socket.send_fds(sock, [hello], [out_fd] + ([pair[1].fileno()] if pair else []))
        else:
            sock.sendall(hello)
        if hasattr(socket, "recv_fds"):
            data, in_fds, _, _ = socket.recv_fds(sock, _HELLO.size, 2)
        else:  # pragma: no cover - Python without SCM_RIGHTS helpers
            data = sock.recv(_HELLO.size)
        if not data:
            raise ConnectionError("connection closed")
        if len(data) < _HELLO.size:
            data += recv_exact(sock, _HELLO.size - len(data))
        flag, announced, peer_addr, peer_token = _HELLO.unpack(data)
        # In-place reads go only to the process the kernel reports at the other end of this
        # Unix socket (SO_PEERCRED, a pid of this namespace), never to the pid the peer
        # announces (of its own namespace, and its word only).
        peer_pid = _socket_peer_pid(sock)
        can = CMA and peer_pid > 0 and cma.probe(peer_pid, peer_addr, peer_token)
        if CMA and not can and peer_pid != announced:
            get_logger().debug(
                "tcp mode: rank %d (%s) announced pid %d, the kernel reports pid %d for its "
                "connection; no in-place reads on that link unless its token is found there",
                peer_global, fabric.describe(peer_global), announced, peer_pid)
        sock.sendall(b"C" if can else b"c")  # both ends must be able to read the other
        peer_can = recv_exact(sock, 1) == b"C"
    except OSError as exc:
        for fd in in_fds:
            os.close(fd)
        _close(out_fd, pair, out_map)
        raise fabric.fail(HorovodInternalError(
            f"rank {fabric.rank} could not set up its link to rank {peer_global} "
            f"({fabric.describe(peer_global)}): {exc}. That rank probably died; check its "
            "log.")) from exc
    if out_fd >= 0:
        os.close(out_fd)  # the mappings (ours and the peer's) keep the memory
    if pair is not None:
        pair[1].close()  # the peer holds that end now; ours must go for EOF to reach us
    if flag != b"Y" or out_map is None or len(in_fds) != (1 if lower else 2):
        for fd in in_fds:
            os.close(fd)
        _close(-1, pair, out_map)
        return Link(fabric, sock, peer, peer_global, plane)
    try:
        in_map = mmap.mmap(in_fds[0], RING + _CTL, prot=mmap.PROT_READ)
    finally:
        os.close(in_fds[0])
    credit = pair[0] if pair else socket.socket(fileno=in_fds[1])
    return ShmLink(fabric, sock, peer, peer_global, plane, out_map, in_map, credit,
                   peer_pid if can and peer_can else 0)


def _socket_peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of Unix socket `sock` (the one that connected
    it, or made the listener it connected to), as the kernel reports it: 0 when unknown (no
    SO_PEERCRED, or a pid namespace this process cannot see)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return 0
    try:
        return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _UCRED.size))[0]
    except OSError:
        return 0


def _close(fd: int, pair: Any, out_map: Any) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    if pair is not None:
        pair[0].close()
        pair[1].close()
    if out_map is not None:
        out_map.close()


class ShmLink(Link):
    """A same-host link: stream data through shared-memory rings, or read in place from the
    sender's memory (cross-memory attach) where the kernel allows it."""

    holds_a_chunk = True  # the ring (RING bytes) takes a whole chunk

    def __init__(self, fabric: Fabric, sock: socket.socket, peer: int, peer_global: int,
                 plane: str, out_map: mmap.mmap, in_map: mmap.mmap,
                 credit: socket.socket, cma_pid: int = 0) -> None:
        super().__init__(fabric, sock, peer, peer_global, plane)
        # With a peer pid, stream data is not copied into the ring: notes carry the address
        # of the sender's memory, the receiver reads it with process_vm_readv, and a post is
        # done when the peer has read it (its released-byte count passes the post's end).
        self._cma = cma_pid
        self.zero_copy = bool(cma_pid)
        self._posted = 0  # CMA: bytes ever posted
        self._out_map, self._in_map = out_map, in_map
        self._out = np.frombuffer(out_map, dtype=np.uint8)
        self._in = np.frombuffer(in_map, dtype=np.uint8)
        self._credit = credit
        # Credits live in shared memory (each side publishes, after its ring, how much of the
        # peer's ring it released); the credit socket only carries wake-up bytes, sent after
        # the counter is stored and never waited on by the sender of the byte. A full socket
        # holds unread bytes, so dropping a wake-up can never lose one. Non-blocking in
        # Python's sense: waits go through poll() with the fabric's timeout.
        credit.setblocking(False)
        self._cpoll = select.poll()
        self._cpoll.register(credit, select.POLLIN)
        self._cwait_ms = int(fabric.timeout * 1000) if fabric.timeout > 0 else -1
        self._cbuf = bytearray(4096)
        fabric.track(credit)
        self._released = np.frombuffer(out_map, dtype=np.uint64, count=1, offset=RING)
        self._peer_released = np.frombuffer(in_map, dtype=np.uint64, count=1, offset=RING)
        self._head = 0  # bytes of my ring handed out (monotonic, skips included)
        self._tail = 0  # bytes of the peer's ring I have released
        self._rec: list[int] | None = None  # current incoming record: [offset, length, used]
        self._note = bytearray(_NOTE.size)

    # -- sending ------------------------------------------------------------------------------
    def _free(self) -> int:
        return RING - (self._head - int(self._peer_released[0]))

    def post(self, view: memoryview, direct: bool = True) -> int:
        """Copies what fits into the ring now, from the calling thread, and queues the rest
        for the sender thread (which waits for space). Writing never waits here, so `direct`
        needs no special care; doing it inline saves a thread hand-off per record.

        With cross-memory attach, only announces where `view` is (no copy); the ticket
        completes once the peer has read it."""
        if self._cma:
            n = view.nbytes
            if n:
                addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
                self._posted += n
                self.send(_NOTE.pack(addr, n))
            return self._posted
        if not self._pending and INLINE:
            try:
                k = self._write(view, wait=False)
            except OSError as exc:
                raise self._error(exc, "sending to") from exc
            if k == view.nbytes:
                return 0
            view = view[k:]
        return self._enqueue(view, False)

    def _emit(self, raw: bool, view: memoryview) -> None:
        if raw:
            self.sock.sendall(view)
        else:
            self._write(view)

    def _write(self, view: memoryview, wait: bool = True) -> int:
        """Copies `view` into the ring as records, each announced by a note; without `wait`,
        stops at the first record that does not fit. Returns the bytes written."""
        src = np.frombuffer(view, dtype=np.uint8)
        n, off = src.size, 0
        while off < n:
            m = min(n - off, MAX_RECORD)
            alen = _align(m)
            pos = self._head % RING
            skip = RING - pos if pos + alen > RING else 0
            while self._free() < skip + alen:
                if not wait:
                    return off
                self._wait_space()
            self._head += skip
            pos = self._head % RING
            self._out[pos:pos + m] = src[off:off + m]
            self._head += alen
            self.sock.sendall(_NOTE.pack(pos, m))
            off += m
        return off

    def wait_sent(self, ticket: int) -> None:
        if not self._cma:
            super().wait_sent(ticket)
            return
        while int(self._peer_released[0]) < ticket:
            self._wait_space()

    def flush(self) -> None:
        if self._cma:
            self.wait_sent(self._posted)
        super().flush()

    def _wait_space(self) -> None:
        """Blocks until the peer sends a wake-up byte (it stored a new count first)."""
        try:
            if not self._cpoll.poll(self._cwait_ms):
                raise socket.timeout("timed out")
            while True:  # drain: the count in shared memory is what matters
                r = self._credit.recv_into(self._cbuf)
                if r == 0:
                    raise ConnectionError("connection closed")
                if r < len(self._cbuf):
                    return
        except BlockingIOError:
            return
        except OSError as exc:
            raise self._error(exc, "waiting for shared-memory space from") from exc

    # -- receiving ----------------------------------------------------------------------------
    def _next_record(self) -> list[int]:
        self.recv_raw(memoryview(self._note), bulk=True)
        pos, m = _NOTE.unpack(self._note)
        if self._cma:
            self._rec = [pos, m, 0]
            return self._rec
        expect = self._tail % RING
        if pos != expect:
            if pos != 0 or expect + _align(m) <= RING:
                raise self.fabric.fail(HorovodInternalError(
                    f"shared-memory stream from rank {self.peer_global} is out of step (record "
                    f"at {pos}, expected {expect}); ranks ran different collectives"))
            self._tail += RING - expect
        self._rec = [pos, m, 0]
        return self._rec

    def _release(self, rec: list[int], k: int) -> None:
        rec[2] += k
        if rec[2] == rec[1]:
            self._tail += rec[1] if self._cma else _align(rec[1])
            self._rec = None
            self._released[0] = self._tail
            try:
                self._credit.send(b"\x01")
            except OSError:
                # Full (unread wake-ups are pending anyway), or the peer closed, maybe just
                # done and shutting down; if it still needed space, its link reports it.
                pass

    def recv_into(self, view: memoryview) -> None:
        dst = np.frombuffer(view, dtype=np.uint8)
        n, got = dst.size, 0
        while got < n:
            rec = self._rec or self._next_record()
            pos, m, used = rec
            k = min(m - used, n - got)
            if self._cma:
                self._cma_read(dst[got:got + k].ctypes.data, pos + used, k)
            else:
                dst[got:got + k] = self._in[pos + used:pos + used + k]
            got += k
            self._release(rec, k)

    def recv_reduce(self, a: np.ndarray, out: np.ndarray, ufunc: Any, tmp: np.ndarray) -> None:
        item = a.itemsize
        n, got = a.size, 0
        while got < n:
            rec = self._rec or self._next_record()
            pos, m, used = rec
            k = min((m - used) // item, n - got)
            if k == 0:  # an element split across records: never posted that way, but be exact
                super().recv_reduce(a[got:got + 1], out[got:got + 1], ufunc, tmp)
                got += 1
                continue
            if self._cma:
                k = min(k, tmp.size)
                inc = tmp[:k]
                self._cma_read(inc.ctypes.data, pos + used, k * item)
            else:
                inc = np.frombuffer(self._in_map, dtype=a.dtype, count=k, offset=pos + used)
            ufunc(a[got:got + k], inc, out=out[got:got + k])
            got += k
            self._release(rec, k * item)

    @property
    def peer_pid(self) -> int:
        """The peer's pid when this link reads its memory in place, else 0."""
        return self._cma

    def read_peer(self, local: int, remote: int, n: int) -> None:
        """Copies `n` bytes at address `remote` of the peer to `local` here (zero-copy links).

        Raises:
            HorovodInternalError: the peer is gone or the kernel refused.
        """
        self._cma_read(local, remote, n)

    def _cma_read(self, local: int, remote: int, n: int) -> None:
        try:
            cma.read(self._cma, local, remote, n)
        except OSError as exc:
            raise self._error(exc, "reading the memory of") from exc

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self.fabric.untrack(self._credit)
        self._credit.close()
        self._out = self._in = None  # type: ignore[assignment]
        self._released = self._peer_released = None  # type: ignore[assignment]
        for m in (self._out_map, self._in_map):
            try:
                m.close()
            except BufferError:  # a numpy view still exists somewhere; the GC unmaps it
                pass
