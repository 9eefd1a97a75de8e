"""Rendezvous key-value store over TCP, authenticated with the job secret (stdlib only).

`hvdrun --tcp` runs a `KVServer`; workers reach it with a `KVClient` to publish and look up the
addresses of their peers. Under torchrun / Ray Train, rank 0 of the tcp mode runs the server
itself (see `collective/engines/tcp.py`).

Wire protocol (nothing is ever unpickled; every field has a fixed layout):

* Handshake, before any request is read (`handshake_server` / `handshake_client`, shared with
  the tcp data plane under another `magic` so a connection of one kind cannot pass as the other):

  1. server -> client: ``magic`` (8 bytes) + server nonce (32 bytes)
  2. client -> server: client nonce (32) + hello length (u16, at most 1 KiB) + hello +
     ``HMAC(secret, "C" + magic + server nonce + client nonce + hello)``
  3. server checks it (constant-time); on failure it logs the peer's address and closes.
     Otherwise server -> client: ``HMAC(secret, "S" + magic + client nonce + server nonce +
     hello)``, which the client checks: authentication is mutual.

  Both sides derive ``session = HMAC(secret, "K" + server nonce + client nonce)``.
* Requests and replies, after the handshake: ``u32 length`` + body + ``HMAC(session, direction
  + u64 sequence number + body)``. A frame with a wrong MAC (forged, replayed or reordered)
  closes the connection and is logged. Unauthenticated peers can make the server read at most
  a fixed handful of bytes (the hello is bounded), within one deadline for the whole handshake
  (`HANDSHAKE_TIMEOUT`); each listener works on at most `MAX_PENDING` of them at a time, all
  on one thread (`PreAuthGate`), and logs refusals throttled (`RefusalLog`).
* Request body: ``op`` (1 byte: P put, G get, D delete) + ``u16 scope length`` + ``u16 key
  length`` + scope + key + (P: the value | G: ``u32`` milliseconds to wait for the key).
  Reply body: status (1 byte: 0 ok + value, 1 not found, 2 error + UTF-8 message).

A get waits on the server (one condition variable), so a waiting client costs no CPU and no
polling traffic; the client reconnects with backoff if the server is not up yet or restarts.
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
from .errors import CollectiveTimeoutError, HorovodInternalError

__all__ = ["KVServer", "KVClient", "PreAuthGate", "RefusalLog", "handshake_server",
           "handshake_client", "recv_exact", "KV_MAGIC", "HANDSHAKE_TIMEOUT", "MAX_VALUE_BYTES",
           "MAX_PENDING"]

KV_MAGIC = b"RVODKV01"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_HELLO_BYTES = 1024
HANDSHAKE_TIMEOUT = 10.0  # seconds an unauthenticated peer may take to prove the secret
MAX_VALUE_BYTES = 1 << 30  # authenticated frames only; horovod.run ships pickled functions
MAX_KEY_BYTES = 4096
MAX_CONNECTIONS = 4096

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_REQ = struct.Struct("!cHH")

# Sent instead of the server's proof when the client's proof is wrong, so that the client can
# tell a refused secret (final) from a connection dropped under load (worth retrying).
REFUSED = b"RVOD-REFUSED-BAD-SECRET-PROOF..."
assert len(REFUSED) == 32

_OK, _NOT_FOUND, _ERROR = 0, 1, 2
_TO_SERVER, _TO_CLIENT = b"c", b"s"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Reads exactly `n` bytes; with `deadline` (time.monotonic()), all of them by then,
    else the socket's timeout applies to each read.

    Raises:
        ConnectionError: the peer closed the connection first.
        socket.timeout: a read timed out, or the deadline passed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"timed out after {got} of {n} bytes")
            sock.settimeout(left)
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += r
    return bytes(buf)


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


class _Channel:
    """An authenticated connection: MAC'd, sequence-numbered frames in both directions."""

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
        if n < MAC_BYTES or n > self.max_frame + MAX_KEY_BYTES * 2 + 64:
            return None
        frame = recv_exact(self.sock, n)
        body, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(self.key, self.recv_dir,
                                             _U64.pack(self.recv_seq), body)):
            return None
        self.recv_seq += 1
        return body


def _pack_request(op: bytes, scope: str, key: str, tail: bytes = b"") -> bytes:
    s, k = scope.encode(), key.encode()
    if len(s) > MAX_KEY_BYTES or len(k) > MAX_KEY_BYTES:
        raise ValueError(f"rendezvous scope/key too long: {scope[:40]!r}/{key[:40]!r}")
    return _REQ.pack(op, len(s), len(k)) + s + k + tail


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class KVServer:
    """Threaded key-value store: one thread authenticates new connections (`PreAuthGate`),
    one serves each authenticated client.

    Attributes:
        handshake_timeout: seconds an unauthenticated connection may take for the whole
            handshake.
        max_pending: unauthenticated connections worked on at once.

    Example:
        >>> server = KVServer("127.0.0.1", 0, secret)
        >>> host, port = server.start()
        >>> KVClient(host, port, secret).put("global", "0", b"10.0.0.1:4000")
    """

    handshake_timeout = HANDSHAKE_TIMEOUT
    max_pending = MAX_PENDING

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes = b"") -> None:
        self.host, self.port, self._secret = host, port, secret
        self._data: dict[tuple[str, str], bytes] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._listener: socket.socket | None = None
        self._gate: PreAuthGate | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> tuple[str, int]:
        """Binds `host:port` (port 0 picks a free one) and starts serving.

        Returns:
            The bound ``(host, port)``.

        Raises:
            OSError: the address cannot be bound (in use, or not an address of this host).
        """
        if not self._secret:
            get_logger().debug("rendezvous server on %s runs without a job secret", self.host)
        sock = socket.socket(_family(self.host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._gate = PreAuthGate([sock], self._secret, KV_MAGIC, self._spawn,
                                 f"rendezvous server {self.host}:{self.port}",
                                 self.handshake_timeout, self.max_pending)
        self._gate.start(f"hvd-kv-accept-{self.port}")
        return self.host, self.port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stop(self) -> None:
        """Closes the listener and every connection, wakes waiting gets, joins all threads."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        if self._gate is not None:
            self._gate.stop()
        with self._conns_lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in conns:
            thread.join()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> "KVServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- local access -------------------------------------------------------------------------
    def put(self, scope: str, key: str, value: bytes) -> None:
        """Stores `value` and wakes the gets waiting for it."""
        with self._cond:
            self._data[(scope, key)] = bytes(value)
            self._cond.notify_all()

    def get(self, scope: str, key: str) -> bytes | None:
        """The value, or None when the key is absent (never waits)."""
        with self._cond:
            return self._data.get((scope, key))

    def delete(self, scope: str, key: str) -> None:
        with self._cond:
            self._data.pop((scope, key), None)

    def _wait_get(self, scope: str, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                v = self._data.get((scope, key))
                left = deadline - time.monotonic()
                if v is not None or left <= 0 or self._stopping:
                    return v
                self._cond.wait(left)

    # -- network ------------------------------------------------------------------------------
    def _spawn(self, sock: socket.socket, hello: bytes, key: bytes, peer: str) -> None:
        """Gate thread: an authenticated client gets a thread of its own."""
        with self._conns_lock:
            if self._stopping or len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                if not self._stopping:
                    self._gate.refusals.refused(  # type: ignore[union-attr]
                        peer, f"{MAX_CONNECTIONS} authenticated clients are connected already")
                return
            t = threading.Thread(target=self._serve, args=(sock, key, peer),
                                 name=f"hvd-kv-conn-{peer}", daemon=True)
            self._conns[sock] = t
        t.start()

    def _serve(self, sock: socket.socket, key: bytes, peer: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            chan = _Channel(sock, key, _TO_CLIENT, _TO_SERVER, MAX_VALUE_BYTES)
            sock.settimeout(None)  # authenticated clients may idle for the job's lifetime
            while not self._stopping:
                body = chan.recv()
                if body is None:
                    get_logger().warning(
                        "rendezvous server %s:%d dropped a connection from %s: a frame failed "
                        "authentication (forged, replayed or corrupted)",
                        self.host, self.port, peer)
                    return
                chan.send(self._handle(body))
        except (OSError, ValueError):
            pass  # the client went away, or stop() shut the socket
        finally:
            sock.close()
            with self._conns_lock:
                self._conns.pop(sock, None)

    def _handle(self, body: bytes) -> bytes:
        try:
            op, ls, lk = _REQ.unpack_from(body)
            pos = _REQ.size
            scope = body[pos:pos + ls].decode()
            key = body[pos + ls:pos + ls + lk].decode()
            tail = body[pos + ls + lk:]
        except (struct.error, UnicodeDecodeError) as exc:
            return bytes([_ERROR]) + f"malformed request: {exc}".encode()
        if op == b"P":
            self.put(scope, key, tail)
            return bytes([_OK])
        if op == b"G":
            (wait_ms,) = _U32.unpack(tail[:4]) if len(tail) == 4 else (0,)
            v = self._wait_get(scope, key, wait_ms / 1000.0)
            return bytes([_NOT_FOUND]) if v is None else bytes([_OK]) + v
        if op == b"D":
            self.delete(scope, key)
            return bytes([_OK])
        return bytes([_ERROR]) + f"unknown op {op!r}".encode()


def _fmt(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "?"


class KVClient:
    """Client of a `KVServer`; connects lazily, retries until `timeout`, thread-safe."""

    def __init__(self, addr: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        self.addr, self.port, self._secret, self.timeout = addr, int(port), secret, timeout
        self._chan: _Channel | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _where(self) -> str:
        return f"the rendezvous server at {self.addr}:{self.port}"

    def _connect(self, deadline: float) -> _Channel:
        delay = 0.01
        last: BaseException | None = None
        while not self._closed:
            sock = None
            try:
                left = max(deadline - time.monotonic(), 0.05)
                sock = socket.create_connection((self.addr, self.port), timeout=min(left, 10.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                key = handshake_client(sock, self._secret, KV_MAGIC, b"kv",
                                       min(left, HANDSHAKE_TIMEOUT), self._where())
                return _Channel(sock, key, _TO_SERVER, _TO_CLIENT, MAX_VALUE_BYTES)
            except HorovodInternalError:
                if sock is not None:
                    sock.close()
                raise
            except OSError as exc:
                if sock is not None:
                    sock.close()
                last = exc
            if time.monotonic() + delay > deadline:
                raise CollectiveTimeoutError(
                    f"could not reach {self._where()} within {self.timeout:.0f} s ({last}). "
                    "Check that the launcher (hvdrun, or rank 0 under torchrun) is running, "
                    "that this host can reach that address, and the firewall; raise "
                    "HOROVOD_GLOO_TIMEOUT_SECONDS if startup is slow.") from last
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise HorovodInternalError(f"KVClient for {self._where()} is closed")

    def _request(self, body: bytes, wait: float, deadline: float,
                 what: Callable[[], str]) -> bytes:
        with self._lock:
            if self._closed:
                raise HorovodInternalError(f"KVClient for {self._where()} is closed")
            while True:
                if self._chan is None:
                    self._chan = self._connect(deadline)
                chan = self._chan
                try:
                    chan.sock.settimeout(wait + max(self.timeout, 5.0))
                    chan.send(body)
                    reply = chan.recv()
                    if reply is None:
                        raise ConnectionError("reply failed authentication")
                except OSError as exc:
                    chan.sock.close()
                    self._chan = None
                    if self._closed:
                        raise HorovodInternalError(
                            f"{what()}: the KVClient was closed") from exc
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(
                            f"{what()}: lost {self._where()} ({exc}) and could not reconnect "
                            f"within {self.timeout:.0f} s") from exc
                    continue  # the server restarted or dropped us: reconnect and retry
                if reply[:1] == bytes([_ERROR]):
                    raise HorovodInternalError(
                        f"{what()}: {self._where()} answered: {reply[1:].decode(errors='replace')}")
                return reply

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Stores `value` under `scope/key`.

        Raises:
            CollectiveTimeoutError: the server cannot be reached within the timeout.
            HorovodInternalError: the server refused the secret.
        """
        deadline = time.monotonic() + self.timeout
        self._request(_pack_request(b"P", scope, key, bytes(value)), 0.0, deadline,
                      lambda: f"put of {scope}/{key}")

    def get(self, scope: str, key: str, timeout: float | None = None) -> bytes:
        """The value of `scope/key`, waiting (on the server) until some rank puts it.

        Raises:
            CollectiveTimeoutError: the key did not appear within `timeout` (default: the
                client's timeout), naming the key, the server address and the fix.
            HorovodInternalError: the server refused the secret.
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            ms = min(int(left * 1000), 0xFFFFFFFF)
            reply = self._request(_pack_request(b"G", scope, key, _U32.pack(ms)), left,
                                  deadline, lambda: f"get of {scope}/{key}")
            if reply[0] == _OK:
                return reply[1:]
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"timed out after {wait:.1f} s waiting for key {scope!r}/{key!r} at "
                    f"{self.addr}:{self.port}: the process that should publish it has not "
                    "started or has failed. Check every rank's log, or raise "
                    "HOROVOD_GLOO_TIMEOUT_SECONDS (hvdrun --gloo-timeout-seconds / "
                    "--start-timeout) if startup is slow.")

    def delete(self, scope: str, key: str) -> None:
        """Removes `scope/key` (no error when absent).

        Raises:
            CollectiveTimeoutError: the server cannot be reached within the timeout.
        """
        deadline = time.monotonic() + self.timeout
        self._request(_pack_request(b"D", scope, key), 0.0, deadline,
                      lambda: f"delete of {scope}/{key}")

    def close(self) -> None:
        """Closes the connection (a get waiting in another thread fails); later calls raise."""
        self._closed = True
        chan = self._chan
        if chan is not None:
            try:
                chan.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            if self._chan is not None:
                self._chan.sock.close()
                self._chan = None

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
