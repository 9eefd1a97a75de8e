"""Rendezvous key-value store over TCP, authenticated with the job secret (stdlib only).

`hvdrun --tcp` runs a `KVServer`; workers reach it with a `KVClient` to publish and look up the
addresses of their peers. Under torchrun / Ray Train, rank 0 of the tcp mode runs the server
itself (see `collective/engines/tcp/plane.py`).

Wire protocol (nothing is ever unpickled; every field has a fixed layout):

* Every connection first passes the handshake of `collective.auth` under `KV_MAGIC` (the tcp
  data plane uses another magic, so a connection of one kind cannot pass as the other). The
  server runs it for all new connections on one thread (`auth.PreAuthGate`), within
  `HANDSHAKE_TIMEOUT`, at most `MAX_PENDING` at a time.
* Requests and replies are authenticated frames (`auth.Channel`); a frame with a wrong MAC
  (forged, replayed or reordered) closes the connection and is logged.
* Request body: ``op`` (1 byte: P put, G get, D delete) + ``u16 scope length`` + ``u16 key
  length`` + scope + key + (P: the value | G: ``u32`` milliseconds to wait for the key).
  Reply body: status (1 byte: 0 ok + value, 1 not found, 2 error + UTF-8 message).

A get waits on the server (one condition variable), so a waiting client costs no CPU and no
polling traffic; the client reconnects with backoff if the server is not up yet or restarts.
While a get waits, the server checks its client's socket every `PEER_CHECK_INTERVAL` seconds
and drops the connection once the client has closed it, so a client that hangs up in the
middle of a long get does not hold a server thread and socket until the get's wait runs out.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable

from ._log import get_logger
from .auth import HANDSHAKE_TIMEOUT, MAX_PENDING, Channel, PreAuthGate, handshake_client
from .errors import CollectiveTimeoutError, HorovodInternalError

__all__ = ["KVServer", "KVClient", "KV_MAGIC", "MAX_VALUE_BYTES"]

KV_MAGIC = b"RVODKV01"
MAX_VALUE_BYTES = 1 << 30  # authenticated frames only; horovod.run ships pickled functions
MAX_KEY_BYTES = 4096
MAX_CONNECTIONS = 4096
PEER_CHECK_INTERVAL = 1.0  # seconds between checks that the client of a waiting get is there
# The longest frame a client may send: a put of the largest value, its scope and key, the
# request header and the MAC.
MAX_FRAME = MAX_VALUE_BYTES + MAX_KEY_BYTES * 2 + 64

_U32 = struct.Struct("!I")
_REQ = struct.Struct("!cHH")

_OK, _NOT_FOUND, _ERROR = 0, 1, 2
_TO_SERVER, _TO_CLIENT = b"c", b"s"


def _pack_request(op: bytes, scope: str, key: str, tail: bytes = b"") -> bytes:
    s, k = scope.encode(), key.encode()
    if len(s) > MAX_KEY_BYTES or len(k) > MAX_KEY_BYTES:
        raise ValueError(f"rendezvous scope/key too long: {scope[:40]!r}/{key[:40]!r}")
    return _REQ.pack(op, len(s), len(k)) + s + k + tail


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _peer_closed(sock: socket.socket) -> bool:
    """True when the peer has closed (or reset) the connection. Reads nothing: bytes the
    peer sent are left for the next read. `sock` must be in blocking mode (no timeout), so
    that MSG_DONTWAIT makes this one non-blocking system call."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # nothing to read: the connection is open
    except OSError:
        return True


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

    def _wait_get(self, scope: str, key: str, timeout: float,
                  client: socket.socket) -> bytes | None:
        """The value, or None when it did not appear within `timeout` seconds.

        Raises:
            ConnectionError: `client` (the socket of the requesting client) was closed while
                the get waited; checked every `PEER_CHECK_INTERVAL` seconds.
        """
        now = time.monotonic()
        deadline, check_at = now + timeout, now + PEER_CHECK_INTERVAL
        with self._cond:
            while True:
                v = self._data.get((scope, key))
                now = time.monotonic()
                if v is not None or now >= deadline or self._stopping:
                    return v
                if now >= check_at:
                    if _peer_closed(client):
                        raise ConnectionError("the client closed the connection during a get")
                    check_at = now + PEER_CHECK_INTERVAL
                self._cond.wait(min(deadline, check_at) - now)

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
            chan = Channel(sock, key, _TO_CLIENT, _TO_SERVER, MAX_FRAME)
            # Authenticated clients may idle for the job's lifetime; blocking mode is also
            # what `_peer_closed` needs.
            sock.settimeout(None)
            while not self._stopping:
                body = chan.recv()
                if body is None:
                    get_logger().warning(
                        "rendezvous server %s:%d dropped a connection from %s: a frame failed "
                        "authentication (forged, replayed or corrupted)",
                        self.host, self.port, peer)
                    return
                chan.send(self._handle(body, sock))
        except (OSError, ValueError):
            pass  # the client went away, or stop() shut the socket
        finally:
            sock.close()
            with self._conns_lock:
                self._conns.pop(sock, None)

    def _handle(self, body: bytes, sock: socket.socket) -> bytes:
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
            v = self._wait_get(scope, key, wait_ms / 1000.0, sock)
            return bytes([_NOT_FOUND]) if v is None else bytes([_OK]) + v
        if op == b"D":
            self.delete(scope, key)
            return bytes([_OK])
        return bytes([_ERROR]) + f"unknown op {op!r}".encode()


class KVClient:
    """Client of a `KVServer`; connects lazily, retries until `timeout`, thread-safe."""

    def __init__(self, addr: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        self.addr, self.port, self._secret, self.timeout = addr, int(port), secret, timeout
        self._chan: Channel | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _where(self) -> str:
        return f"the rendezvous server at {self.addr}:{self.port}"

    def _connect(self, deadline: float) -> Channel:
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
                return Channel(sock, key, _TO_SERVER, _TO_CLIENT, MAX_FRAME)
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
