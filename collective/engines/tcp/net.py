"""Sockets of the tcp mode: the per-process `Fabric` (listeners, accept thread, first-failure
state). The `Link` to one peer lives in `link`.

Connections:

* Each process listens on the job's interface (TCP) and, on Linux, on an abstract Unix socket.
  Peers on the same host (same boot id and network namespace) connect over the Unix socket,
  which skips the TCP stack (measured about 1.6x the bandwidth of loopback TCP at 16 MiB on
  the 2-core CI box); others over TCP.
* Every connection is authenticated with the job secret (the handshake of
  `collective.rendezvous`, under its own magic) before it is used. Its hello names the session,
  the plane and the connecting rank; the listeners' gate (one thread, a selector, a deadline
  for the whole handshake, a cap on pending connections) files it under that hello, and the
  plane that needs it picks it up. Data frames are not MAC'd: the connection is bound to the
  handshake (a per-frame HMAC would halve the bandwidth).
* Of each pair, the higher global rank connects and the lower accepts, so the two ends agree
  without talking.

Failure: the first error on any link (EOF, reset, timeout, desynchronised header) is recorded
on the fabric with the peer's rank and host, and every socket of the process is shut down, so
that blocked calls here fail at once and the peers see EOF instead of waiting for a timeout.
Every later call raises the same error. `Fabric.abort()` does the same from another thread.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ..._log import get_logger
from ...auth import HANDSHAKE_TIMEOUT, MAX_PENDING, PreAuthGate, handshake_client
from ...errors import CollectiveTimeoutError, HorovodInternalError

__all__ = ["Fabric", "PeerInfo", "host_id", "PEER_MAGIC"]

PEER_MAGIC = b"RVODPR01"
SOCK_BUF = 4 << 20  # capped by net.core.{w,r}mem_max
MAX_PENDING_INCOMING = 4096
# Same-host peers connect over abstract Unix sockets (tests switch this off to run over TCP).
UNIX_SOCKETS = True


def host_id() -> str:
    """Peers with equal ids can reach each other's abstract Unix sockets ("" = unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


class PeerInfo:
    """Where a rank listens, as published in the rendezvous table."""

    __slots__ = ("rank", "host", "ip", "port", "unix", "hostid")

    def __init__(self, rank: int, host: str, ip: str, port: int, unix: str, hostid: str) -> None:
        self.rank, self.host, self.ip, self.port = rank, host, ip, port
        self.unix, self.hostid = unix, hostid

    def to_json(self) -> dict:
        return {"rank": self.rank, "host": self.host, "ip": self.ip, "port": self.port,
                "unix": self.unix, "hostid": self.hostid}

    @classmethod
    def from_json(cls, d: dict) -> "PeerInfo":
        return cls(int(d["rank"]), str(d["host"]), str(d["ip"]), int(d["port"]),
                   str(d.get("unix", "")), str(d.get("hostid", "")))


def _tune(sock: socket.socket, tcp: bool) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class Fabric:
    """The process's listeners and connection registry, shared by the world plane and its
    splits; owns the first-failure state.

    Attributes:
        max_pending: unauthenticated connections the listeners work on at once (one thread,
            a selector: `collective.auth.PreAuthGate`).
    """

    max_pending = MAX_PENDING

    def __init__(self, rank: int, secret: bytes, timeout: float, bind_ip: str,
                 use_unix: bool | None = None) -> None:
        self.rank, self.secret, self.timeout = rank, secret, timeout
        self.session = ""
        self.peers: dict[int, PeerInfo] = {}
        self.me: PeerInfo | None = None
        self._bind_ip = bind_ip
        if use_unix is None:
            use_unix = UNIX_SOCKETS
        self._use_unix = use_unix and hasattr(socket, "AF_UNIX")
        self._lock = threading.Condition()
        self._incoming: dict[bytes, socket.socket] = {}
        self._sockets: set[socket.socket] = set()
        self._links: set[Any] = set()  # link.Link objects
        self._closing = False
        self.error: BaseException | None = None
        self._listeners: list[socket.socket] = []
        self._gate: PreAuthGate | None = None

    # -- setup --------------------------------------------------------------------------------
    def start(self, hostname: str) -> PeerInfo:
        """Opens the listeners and the accept thread; returns this rank's address.

        Raises:
            OSError: the job's interface address cannot be bound.
        """
        fam = socket.AF_INET6 if ":" in self._bind_ip else socket.AF_INET
        tcp = socket.socket(fam, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(tcp, True)
        tcp.bind((self._bind_ip, 0))
        tcp.listen(256)
        self._listeners.append(tcp)
        unix_name, hid = "", ""
        if self._use_unix and (hid := host_id()):
            name = f"\0ringvod-{os.getpid()}-{os.urandom(6).hex()}"
            try:
                ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                _tune(ux, False)
                ux.bind(name)
                ux.listen(256)
                self._listeners.append(ux)
                unix_name = name[1:]
            except OSError as exc:  # not Linux, or sandboxed: TCP only
                get_logger().debug("tcp mode: no abstract Unix socket (%s)", exc)
                hid = ""
        self.me = PeerInfo(self.rank, hostname, self._bind_ip, tcp.getsockname()[1], unix_name,
                           hid)
        self._gate = PreAuthGate(self._listeners, self.secret, PEER_MAGIC, self._authenticated,
                                 f"tcp mode: rank {self.rank}",
                                 min(self.timeout, HANDSHAKE_TIMEOUT), self.max_pending)
        self._gate.start(f"hvd-tcp-accept-{self.rank}")
        return self.me

    def set_table(self, session: str, peers: list[PeerInfo]) -> None:
        self.session = session
        self.peers = {p.rank: p for p in peers}

    # -- accepting ----------------------------------------------------------------------------
    def _authenticated(self, sock: socket.socket, hello: bytes, key: bytes, peer: str) -> None:
        """Gate thread: files a connection that proved the secret under its hello."""
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if not self._closing and len(self._incoming) < MAX_PENDING_INCOMING:
                old = self._incoming.pop(hello, None)
                if old is not None:  # a retried dial replaces its earlier connection
                    self._sockets.discard(old)
                    old.close()
                self._incoming[hello] = sock
                self._sockets.add(sock)
                self._lock.notify_all()
                return
        sock.close()

    # -- connections --------------------------------------------------------------------------
    def _hello(self, plane_id: str, rank: int) -> bytes:
        return f"{self.session}/{plane_id}/{rank}".encode()

    def connect(self, plane_id: str, peer: int, deadline: float) -> socket.socket:
        """An authenticated connection to global rank `peer` for plane `plane_id`.

        Raises:
            HorovodInternalError: authentication failed, or the fabric has failed.
            CollectiveTimeoutError: the peer cannot be reached before `deadline`.
        """
        assert self.me is not None
        info = self.peers[peer]
        if self.rank > peer:
            return self._dial_and_authenticate(plane_id, info, deadline)
        key = self._hello(plane_id, peer)
        with self._lock:
            while key not in self._incoming:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank} waited {self.timeout:.0f} s for rank {peer} "
                        f"({self.describe(peer)}) to connect (plane {plane_id}). That rank may "
                        "have failed, or cannot reach this host; check its log, the network and "
                        "firewall, or raise HOROVOD_GLOO_TIMEOUT_SECONDS.")
                self._lock.wait(min(left, 1.0))
            return self._incoming.pop(key)

    def _dial_and_authenticate(self, plane_id: str, info: PeerInfo,
                               deadline: float) -> socket.socket:
        """Dials `info` and proves the secret, retrying a failed handshake (the peer's gate
        may have dropped us under a flood of other connections) until `deadline`."""
        hello = self._hello(plane_id, self.rank)
        delay, last = 0.01, None
        while True:
            sock = self._dial(info, deadline)
            try:
                handshake_client(sock, self.secret, PEER_MAGIC, hello,
                                 max(min(deadline - time.monotonic(), HANDSHAKE_TIMEOUT), 0.1),
                                 f"rank {info.rank} ({self.describe(info.rank)})")
            except HorovodInternalError:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                last = exc
            else:
                with self._lock:
                    self._sockets.add(sock)
                sock.setblocking(True)
                return sock
            self.check()
            if time.monotonic() + delay > deadline:
                what = ("timed out" if isinstance(last, socket.timeout)
                        else f"failed: {last}")
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the handshake with rank {info.rank} at "
                    f"{self.describe(info.rank)} (plane {plane_id}) {what} within "
                    f"{self.timeout:.0f} s. The connection was made but that rank did not "
                    "answer: check that rank's log (is it alive, or stuck?), that the address "
                    "belongs to it and not to another service, that every rank has the same "
                    "HOROVOD_SECRET_KEY, and the host's load; raise "
                    "HOROVOD_GLOO_TIMEOUT_SECONDS if startup is slow.") from last
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _dial(self, info: PeerInfo, deadline: float) -> socket.socket:
        local = (self.me is not None and info.unix and info.hostid and
                 info.hostid == self.me.hostid)
        delay, last = 0.005, None
        while True:
            self.check()
            sock = None
            try:
                if local:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    _tune(sock, False)
                    sock.settimeout(max(deadline - time.monotonic(), 0.1))
                    sock.connect("\0" + info.unix)
                else:
                    fam = socket.AF_INET6 if ":" in info.ip else socket.AF_INET
                    sock = socket.socket(fam, socket.SOCK_STREAM)
                    _tune(sock, True)
                    sock.settimeout(max(deadline - time.monotonic(), 0.1))
                    sock.connect((info.ip, info.port))
                return sock
            except OSError as exc:
                if sock is not None:
                    sock.close()
                last = exc
                if local and isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
                    local = False  # another container with our host id: fall back to TCP
                    continue
            if time.monotonic() + delay > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank} could not connect to rank {info.rank} at "
                    f"{self.describe(info.rank)} within {self.timeout:.0f} s ({last}). Check "
                    "that rank's log, the network and the firewall, or set HOROVOD_GLOO_IFACE "
                    "to the interface the hosts share.") from last
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def describe(self, peer: int) -> str:
        info = self.peers.get(peer)
        if info is None:
            return "?"
        return f"host {info.host}, {info.ip}:{info.port}"

    # -- failure ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raises the recorded failure, if any."""
        err = self.error
        if err is not None:
            raise type(err)(str(err))

    def fail(self, exc: BaseException) -> BaseException:
        """Records the first failure, shuts every socket; returns the exception to raise."""
        with self._lock:
            if self.error is None and not self._closing:
                self.error = exc
                get_logger().error("tcp mode: %s", exc)
            first = self.error or exc
            socks = list(self._sockets)
            self._lock.notify_all()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if first is exc:
            return exc
        return type(first)(str(first))

    def abort(self, reason: str) -> None:
        """Fails every current and later call of every plane of this process."""
        self.fail(HorovodInternalError(f"tcp mode aborted on rank {self.rank}: "
                                       f"{reason or 'abort() was called'}"))

    def register(self, link: Any) -> None:
        with self._lock:
            self._links.add(link)

    def track(self, sock: socket.socket) -> None:
        """Shuts `sock` down, too, when the fabric fails."""
        with self._lock:
            self._sockets.add(sock)

    def untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def unregister(self, link: Any) -> None:
        with self._lock:
            self._links.discard(link)
            self._sockets.discard(link.sock)

    def close(self) -> None:
        """Closes listeners and links; joins the gate and sender threads."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        if self._gate is not None:
            self._gate.stop()
        with self._lock:
            links = list(self._links)
            socks = list(self._sockets) + list(self._incoming.values())
            self._incoming.clear()
        for link in links:
            link.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for s in self._listeners:
            s.close()
