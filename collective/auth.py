"""Authentication of ringvod's connections with the job secret (stdlib only).

Both the rendezvous key-value store (`collective.rendezvous`) and the tcp data plane
(`collective.engines.tcp`) authenticate every connection here, each under its own `magic`, so
a connection of one kind cannot pass as the other. Nothing a peer sends is ever unpickled.

* Handshake, before anything else is read (`handshake_server` / `handshake_client`, or
  `PreAuthGate` for a listener that serves many peers on one thread):

  1. server -> client: ``magic`` (8 bytes) + server nonce (32 bytes)
  2. client -> server: client nonce (32) + hello length (u16, at most 1 KiB) + hello +
     ``HMAC(secret, "C" + magic + server nonce + client nonce + hello)``
  3. server checks it (constant-time); on failure it sends `REFUSED`, logs the peer's address
     and closes. Otherwise server -> client: ``HMAC(secret, "S" + magic + client nonce +
     server nonce + hello)``, which the client checks: authentication is mutual.

  Both sides derive ``session = HMAC(secret, "K" + server nonce + client nonce)``.
* Unauthenticated peers can make the server read at most a fixed handful of bytes (the hello
  is bounded), within one deadline for the whole handshake (`HANDSHAKE_TIMEOUT`); a
  `PreAuthGate` works on at most `MAX_PENDING` of them at a time, all on one thread, and logs
  refusals throttled (`RefusalLog`).
* Frames after the handshake (`Channel`): ``u32 length`` + body + ``HMAC(session, direction +
  u64 sequence number + body)``. A frame with a wrong MAC (forged, replayed or reordered) is
  refused. The length is read before the MAC can be checked, so the buffer for a frame
  grows with the bytes that arrive (`recv_exact`): a length alone costs `RECV_STEP` bytes,
  not the frame cap, whoever sends it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from ._log import get_logger
from .errors import HorovodInternalError

__all__ = ["PreAuthGate", "RefusalLog", "Channel", "handshake_server", "handshake_client",
           "recv_exact", "HANDSHAKE_TIMEOUT", "MAX_PENDING", "REFUSED"]

NONCE_BYTES = 32
MAC_BYTES = 32
MAX_HELLO_BYTES = 1024
HANDSHAKE_TIMEOUT = 10.0  # seconds an unauthenticated peer may take to prove the secret
RECV_STEP = 64 << 10  # `recv_exact` allocates this much at first, then grows with the data

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")

# Sent instead of the server's proof when the client's proof is wrong, so that the client can
# tell a refused secret (final) from a connection dropped under load (worth retrying).
REFUSED = b"RVOD-REFUSED-BAD-SECRET-PROOF..."
assert len(REFUSED) == 32


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Reads exactly `n` bytes; with `deadline` (time.monotonic()), all of them by then,
    else the socket's timeout applies to each read.

    `n` often comes from a length the peer sent, before anything could check it (a frame's
    MAC comes after its body), so a large read is not allocated whole: it is read in pieces,
    `RECV_STEP` bytes first, then each as large as what arrived so far. A peer must send
    about half of what it makes this process hold.

    Raises:
        ConnectionError: the peer closed the connection first.
        socket.timeout: a read timed out, or the deadline passed.
    """
    if n <= RECV_STEP:
        return bytes(_fill(sock, n, deadline, 0, n))
    pieces: list[bytearray] = []
    got = 0
    while got < n:
        pieces.append(_fill(sock, min(max(got, RECV_STEP), n - got), deadline, got, n))
        got += len(pieces[-1])
    return b"".join(pieces)


def _fill(sock: socket.socket, k: int, deadline: float | None, before: int,
          n: int) -> bytearray:
    """`k` bytes of a read of `n` of which `before` arrived already (see `recv_exact`)."""
    buf = bytearray(k)
    view = memoryview(buf)
    got = 0
    while got < k:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"timed out after {before + got} of {n} bytes")
            sock.settimeout(left)
        r = sock.recv_into(view[got:], k - got)
        if r == 0:
            raise ConnectionError(f"connection closed after {before + got} of {n} bytes")
        got += r
    return buf


def handshake_server(sock: socket.socket, secret: bytes, magic: bytes,
                     timeout: float = HANDSHAKE_TIMEOUT) -> tuple[bytes, bytes] | None:
    """Server side of the mutual HMAC challenge-response.

    Returns:
        ``(hello, session_key)`` once the client proved the secret, or None when it did not
        (bad proof, oversized hello, timeout, closed early); the caller logs and closes.
    """
    deadline = time.monotonic() + timeout
    try:
        sock.settimeout(timeout)
        sn = os.urandom(NONCE_BYTES)
        sock.sendall(magic + sn)
        head = recv_exact(sock, NONCE_BYTES + _U16.size, deadline)
        cn, (hlen,) = head[:NONCE_BYTES], _U16.unpack(head[NONCE_BYTES:])
        if hlen > MAX_HELLO_BYTES:
            return None
        rest = recv_exact(sock, hlen + MAC_BYTES, deadline)
        hello, proof = rest[:hlen], rest[hlen:]
        if not hmac.compare_digest(proof, _mac(secret, b"C", magic, sn, cn, hello)):
            sock.sendall(REFUSED)
            return None
        sock.sendall(_mac(secret, b"S", magic, cn, sn, hello))
        return hello, _mac(secret, b"K", sn, cn)
    except (OSError, ValueError):
        return None


def handshake_client(sock: socket.socket, secret: bytes, magic: bytes, hello: bytes,
                     timeout: float, where: str) -> bytes:
    """Client side of the handshake; returns the session key.

    Raises:
        HorovodInternalError: the server refused the secret, or failed to prove it knows it.
        OSError: the connection failed (callers may retry).
    """
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    head = recv_exact(sock, len(magic) + NONCE_BYTES, deadline)
    if head[:len(magic)] != magic:
        raise HorovodInternalError(
            f"{where} is not a ringvod endpoint of the expected kind (got {head[:8]!r}); "
            "check the address and port")
    sn = head[len(magic):]
    cn = os.urandom(NONCE_BYTES)
    sock.sendall(cn + _U16.pack(len(hello)) + hello + _mac(secret, b"C", magic, sn, cn, hello))
    try:
        proof = recv_exact(sock, MAC_BYTES, deadline)
    except ConnectionError:
        raise ConnectionError(f"{where} closed the connection during the handshake (busy, "
                              "or shutting down)") from None
    if proof == REFUSED:
        raise HorovodInternalError(
            f"{where} refused authentication: this process's job secret (HOROVOD_SECRET_KEY) "
            "differs from the server's. Start every worker from the same hvdrun, or give all "
            "of them the same secret.")
    if not hmac.compare_digest(proof, _mac(secret, b"S", magic, cn, sn, hello)):
        raise HorovodInternalError(
            f"{where} could not prove it knows the job secret; refusing to talk to it. "
            "Another service may be listening on that port.")
    return _mac(secret, b"K", sn, cn)


MAX_PENDING = 64  # unauthenticated connections one listener works on at a time
REFUSAL_LOG_BURST = 3  # refusals logged one by one per window; the rest are summarised
REFUSAL_LOG_WINDOW = 10.0


class RefusalLog:
    """Throttled WARNINGs about refused connections: the first few of each window one by
    one (naming the peer), the rest as one summary line per window."""

    def __init__(self, what: str, window: float = REFUSAL_LOG_WINDOW,
                 burst: int = REFUSAL_LOG_BURST) -> None:
        self.what, self.window, self.burst = what, window, burst
        self._start = time.monotonic()
        self._logged = 0
        self._held: dict[str, int] = {}
        self._last = ""
        self._lock = threading.Lock()

    def refused(self, peer: str, reason: str) -> None:
        with self._lock:
            self._roll(time.monotonic())
            if self._logged < self.burst:
                self._logged += 1
                get_logger().warning("%s refused a connection from %s: %s", self.what, peer,
                                     reason)
                return
            self._held[reason] = self._held.get(reason, 0) + 1
            self._last = peer

    def _roll(self, now: float) -> None:
        if now - self._start < self.window:
            return
        self.flush(now)
        self._start, self._logged = now, 0

    def flush(self, now: float | None = None) -> None:
        """Logs the summary of refusals held back (if any)."""
        if not self._held:
            return
        now = time.monotonic() if now is None else now
        total = sum(self._held.values())
        why = "; ".join(f"{n}: {r}" for r, n in sorted(self._held.items(), key=lambda x: -x[1]))
        get_logger().warning("%s refused %d more connection(s) in the last %.0f s, most "
                             "recently from %s (%s)", self.what, total,
                             max(now - self._start, 0.0), self._last, why)
        self._held.clear()

    def tick(self) -> None:
        with self._lock:
            self._roll(time.monotonic())


_NO_PROOF = "it did not prove the job secret (wrong or missing HOROVOD_SECRET_KEY)"


class _Pending:
    """One unauthenticated connection in the middle of the server side of the handshake."""

    __slots__ = ("sock", "peer", "deadline", "out", "inbuf", "need", "sn")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, magic: bytes) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.sn = os.urandom(NONCE_BYTES)
        self.out = magic + self.sn
        self.inbuf = b""
        self.need = NONCE_BYTES + _U16.size  # the client nonce and the hello's length first


class PreAuthGate:
    """Accepts on `listeners` and runs the server side of the handshake for every new
    connection on one thread, through a selector.

    Unauthenticated peers get one deadline for the whole handshake (`timeout`), at most
    `max_pending` of them are worked on at a time (a new one evicts the oldest: a flood cannot
    lock out a real peer, whose handshake takes one round trip), and refusals are logged
    throttled (`RefusalLog`). A connection that proves the secret is handed to
    `on_ready(sock, hello, session_key, peer)` in blocking mode; from then on it is the
    owner's. The gate never reads more than the fixed handshake bytes from anyone.
    """

    def __init__(self, listeners: list[socket.socket], secret: bytes, magic: bytes,
                 on_ready: Callable[[socket.socket, bytes, bytes, str], None], what: str,
                 timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING) -> None:
        self.listeners, self.secret, self.magic = listeners, secret, magic
        self.on_ready, self.what = on_ready, what
        self.timeout, self.max_pending = timeout, max_pending
        self.refusals = RefusalLog(what)
        self._pending: dict[socket.socket, _Pending] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.accept_errors = 0

    def start(self, name: str) -> None:
        for s in self.listeners:
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join()
        for p in list(self._pending.values()):
            self._drop(p)
        self.refusals.flush()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                first = min((p.deadline for p in self._pending.values()), default=now + 1.0)
                events = self._sel.select(max(min(first - now, 1.0), 0.0))
                for key, mask in events:
                    obj = key.fileobj
                    if obj is self._wake_r:
                        return
                    if key.data is None:
                        self._accept(obj)  # type: ignore[arg-type]
                    else:
                        self._step(key.data, mask)
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    self._refuse(p, f"no complete handshake within {self.timeout:g} s")
                self.refusals.tick()
        except Exception as exc:  # noqa: BLE001 - never let a bug here pass silently
            get_logger().error("%s: the connection gate failed: %s", self.what, exc)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(256):  # drain the backlog, bounded per round
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                self.accept_errors += 1
                self.refusals.refused("?", f"accept failed: {exc}")
                time.sleep(0.05)
                return
            peer = _fmt(addr) if isinstance(addr, tuple) else "a local process"
            if len(self._pending) >= self.max_pending:
                oldest = min(self._pending.values(), key=lambda p: p.deadline)
                self._refuse(oldest, f"more than {self.max_pending} unauthenticated "
                                     "connections at once (the oldest is dropped)")
            sock.setblocking(False)
            p = _Pending(sock, peer, time.monotonic() + self.timeout, self.magic)
            self._pending[sock] = p
            try:
                self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
            except (OSError, ValueError) as exc:
                self._refuse(p, f"cannot watch the connection: {exc}")

    def _step(self, p: _Pending, mask: int) -> None:
        if self._pending.get(p.sock) is not p:
            return  # dropped earlier in this round (evicted or expired)
        try:
            if p.out and mask & selectors.EVENT_WRITE:
                n = p.sock.send(p.out)
                p.out = p.out[n:]
                if not p.out:
                    self._sel.modify(p.sock, selectors.EVENT_READ, p)
            if mask & selectors.EVENT_READ:
                chunk = p.sock.recv(p.need - len(p.inbuf))
                if not chunk:
                    self._refuse(p, "closed during the handshake")
                    return
                p.inbuf += chunk
                if len(p.inbuf) < p.need:
                    return
                if p.need == NONCE_BYTES + _U16.size:
                    (hlen,) = _U16.unpack_from(p.inbuf, NONCE_BYTES)
                    if hlen > MAX_HELLO_BYTES:
                        self._refuse(p, _NO_PROOF)
                        return
                    p.need += hlen + MAC_BYTES
                    return
                self._finish(p)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(p, f"connection failed during the handshake ({exc})")

    def _finish(self, p: _Pending) -> None:
        cn = p.inbuf[:NONCE_BYTES]
        hello = p.inbuf[NONCE_BYTES + _U16.size:-MAC_BYTES]
        proof = p.inbuf[-MAC_BYTES:]
        if p.out or not hmac.compare_digest(proof, _mac(self.secret, b"C", self.magic, p.sn,
                                                        cn, hello)):
            try:
                p.sock.send(REFUSED)  # best effort: tells a real client its secret is wrong
            except OSError:
                pass
            self._refuse(p, _NO_PROOF)
            return
        self._forget(p)
        sock = p.sock
        try:
            sock.setblocking(True)
            sock.settimeout(max(p.deadline - time.monotonic(), 0.05))
            sock.sendall(_mac(self.secret, b"S", self.magic, cn, p.sn, hello))
            sock.settimeout(None)
        except OSError:
            sock.close()
            return
        self.on_ready(sock, hello, _mac(self.secret, b"K", p.sn, cn), p.peer)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.sock.close()

    def _refuse(self, p: _Pending, reason: str) -> None:
        self._drop(p)
        if not self._stopping:
            self.refusals.refused(p.peer, reason)


class Channel:
    """An authenticated connection: MAC'd, sequence-numbered frames in both directions.

    `send_dir` and `recv_dir` label the two directions (a frame cannot be reflected back to
    its sender); `max_frame` bounds the length of a frame read (body and MAC).
    """

    def __init__(self, sock: socket.socket, key: bytes, send_dir: bytes, recv_dir: bytes,
                 max_frame: int) -> None:
        self.sock, self.key = sock, key
        self.send_dir, self.recv_dir = send_dir, recv_dir
        self.send_seq = self.recv_seq = 0
        self.max_frame = max_frame

    def send(self, body: bytes) -> None:
        mac = _mac(self.key, self.send_dir, _U64.pack(self.send_seq), body)
        self.send_seq += 1
        self.sock.sendall(_U32.pack(len(body) + MAC_BYTES) + body + mac)

    def recv(self) -> bytes | None:
        """The next body, or None when its MAC is wrong or its length out of bounds.

        Raises:
            ConnectionError, socket.timeout: the connection failed.
        """
        (n,) = _U32.unpack(recv_exact(self.sock, _U32.size))
        if n < MAC_BYTES or n > self.max_frame:
            return None
        if n <= RECV_STEP:
            frame = recv_exact(self.sock, n)
            body, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        else:  # large: the body is read as is, neither sliced nor joined again for the MAC
            body = recv_exact(self.sock, n - MAC_BYTES)
            mac = recv_exact(self.sock, MAC_BYTES)
        h = hmac.new(self.key, self.recv_dir + _U64.pack(self.recv_seq), hashlib.sha256)
        h.update(body)
        if not hmac.compare_digest(mac, h.digest()):
            return None
        self.recv_seq += 1
        return body


def _fmt(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "?"
