"""The tcp mode: a control plane over authenticated sockets, and its rendezvous.

Who is who comes from the `Config`:

* `hvdrun --tcp`: `HOROVOD_RANK`/`HOROVOD_SIZE`, the launcher's key-value server at
  `HOROVOD_GLOO_RENDEZVOUS_ADDR`/`_PORT`, and the job secret `HOROVOD_SECRET_KEY` (hex).
* torchrun / Ray Train: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. Rank 0 runs the
  key-value server itself, on `MASTER_PORT + 1` (torchrun's agent may already hold
  `MASTER_PORT`) unless `HOROVOD_GLOO_RENDEZVOUS_PORT` is set, and only while the world
  forms. The job secret is `HOROVOD_SECRET_KEY` (hex), which hvdrun and horovod.run set;
  torchrun and Ray Train set none, and nothing else in their environment is secret (addresses,
  ports and run ids are visible to everyone on the host or network). Without it the handshake
  runs with an empty key: it checks that both ends speak this protocol but authenticates no
  one, and rank 0 logs one warning saying so (loopback jobs included: any local user can
  connect). Even then nothing a peer sends runs as code: the control plane exchanges plain
  data (`collective.wire`), never pickle. Set the same `HOROVOD_SECRET_KEY` on every rank to
  authenticate.
* Otherwise the world is this process alone.

Rendezvous: each rank opens its listeners (`net.Fabric`) on the job's interface
(`HOROVOD_GLOO_IFACE`, else the address this host uses to reach the rendezvous server), and
publishes where it listens as JSON under ``ringvod/tcp/<n>/addr.<rank>`` (`n` counts this
process's inits, so `init` -> `shutdown` -> `init` never reads the previous world's keys).
Rank 0 collects them into ``table`` with a fresh session id; everyone reads it, connects to its
ring neighbours and to rank 0, and a barrier closes the rendezvous.

Topology of a plane: rank 0 holds a link to every rank (a star, for negotiation: gather,
bcast, bitwise allreduce); each rank also links to its ring neighbours (data). Other links
(alltoall, broadcast from another root) are opened on first use. `split()` builds a sub-plane
over new connections tagged with its own id, so traffic of different process sets never
shares a socket.

Everything here runs on the coordinator thread of its process, except `abort()`.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import os
import socket
import struct
import time
from typing import Any, Sequence

import numpy as np

from ..._log import get_logger
from ...errors import HorovodInternalError
from ...rendezvous import KVClient, KVServer
from ..base import ControlPlane
from .link import Link
from .net import Fabric, PeerInfo
from .shm import make_link

__all__ = ["TcpControlPlane", "create_backend", "resolve_job"]

OP_GATHER, OP_BCAST, OP_WORDS, OP_WORDS_OUT, OP_BARRIER = 1, 2, 3, 4, 5

# Inits of the tcp mode in this process: a key prefix, so that a rank that re-inits quickly
# cannot read the rendezvous table of the previous world (all ranks re-init in lockstep).
_INITS = itertools.count()

_WORD_OPS = {"and": np.bitwise_and, "or": np.bitwise_or}


class TcpControlPlane(ControlPlane):
    """Negotiation transport of one group over the fabric's sockets."""

    name = "tcp"

    def __init__(self, fabric: Fabric | None, plane_id: str, global_ranks: list[int],
                 my_global: int, timeout: float, owner: bool = False) -> None:
        self.fabric = fabric
        self.plane_id = plane_id
        self.global_ranks = list(global_ranks)
        self.rank = self.global_ranks.index(my_global)
        self.size = len(self.global_ranks)
        self.timeout = timeout
        self._owner = owner  # the world plane closes the fabric
        self._links: dict[int, Link] = {}
        self._splits = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<TcpControlPlane {self.plane_id} rank {self.rank}/{self.size}>"

    # -- links --------------------------------------------------------------------------------
    def link(self, peer: int) -> Link:
        """The link to group rank `peer`, opened on first use (both ends need it then).

        Raises:
            HorovodInternalError: the fabric failed or the plane is closed.
            CollectiveTimeoutError: the peer did not connect in time.
        """
        link = self._links.get(peer)
        if link is not None:
            return link
        if self._closed or self.fabric is None:
            raise HorovodInternalError(f"tcp plane {self.plane_id} is closed")
        g = self.global_ranks[peer]
        sock = self.fabric.connect(self.plane_id, g, time.monotonic() + self.timeout)
        link = make_link(self.fabric, sock, peer, g, self.plane_id)
        self._links[peer] = link
        return link

    def connect_initial(self) -> None:
        """Opens the star (rank 0 to all) and ring links; dials before it waits."""
        n, r = self.size, self.rank
        if n == 1:
            return
        want = set(range(1, n)) if r == 0 else {0, (r + 1) % n, (r - 1) % n}
        want.discard(r)
        me = self.global_ranks[r]
        for p in sorted(want, key=lambda p: self.global_ranks[p] > me):
            self.link(p)

    # -- primitives ---------------------------------------------------------------------------
    def gather(self, data: bytes) -> list[bytes] | None:
        if self.size == 1:
            return [bytes(data)]
        if self.rank == 0:
            return [bytes(data)] + [bytes(self.link(p).recv_msg(OP_GATHER))
                                    for p in range(1, self.size)]
        link = self.link(0)
        link.send_msg(OP_GATHER, data)
        link.flush()
        return None

    def bcast(self, data: bytes | None) -> bytes:
        if self.size == 1:
            return bytes(data or b"")
        if self.rank == 0:
            payload = bytes(data or b"")
            links = [self.link(p) for p in range(1, self.size)]
            for link in links:
                link.send_msg(OP_BCAST, payload)
            for link in links:
                link.flush()
            return payload
        return bytes(self.link(0).recv_msg(OP_BCAST))

    def allreduce_words(self, words: np.ndarray, op: str) -> np.ndarray:
        ufunc = _WORD_OPS[op]
        out = np.array(words, dtype=np.uint64, copy=True).reshape(-1)
        if self.size > 1:
            small_allreduce(self, out, ufunc, OP_WORDS, OP_WORDS_OUT)
        return out

    def allgather(self, data: bytes) -> list[bytes]:
        if self.size == 1:
            return [bytes(data)]
        parts = self.gather(data)
        if parts is not None:
            lens = struct.pack(f"<{len(parts)}Q", *(len(p) for p in parts))
            packed = self.bcast(lens + b"".join(parts))
        else:
            packed = self.bcast(None)
        n = self.size
        lens_t = struct.unpack_from(f"<{n}Q", packed)
        out, pos = [], 8 * n
        for ln in lens_t:
            out.append(packed[pos:pos + ln])
            pos += ln
        return out

    def barrier(self) -> None:
        if self.size == 1:
            return
        if self.rank == 0:
            links = [self.link(p) for p in range(1, self.size)]
            for link in links:
                link.recv_msg(OP_BARRIER, 0)
            for link in links:
                link.send_msg(OP_BARRIER)
        else:
            link = self.link(0)
            link.send_msg(OP_BARRIER)
            link.recv_msg(OP_BARRIER, 0)

    def split(self, ranks: Sequence[int]) -> "TcpControlPlane | None":
        """Collective over this plane: a sub-plane over new connections for `ranks`.

        Raises:
            HorovodInternalError: the ranks disagree on `ranks`, or a link fails.
            ValueError: `ranks` has duplicates or ranks outside this plane.
        """
        ranks = [int(x) for x in ranks]
        sid = f"{self.plane_id}.{self._splits}"
        self._splits += 1
        views = self.allgather(json.dumps(ranks).encode())
        if len(set(views)) > 1:
            by: dict[str, list[int]] = {}
            for r, v in enumerate(views):
                by.setdefault(v.decode(), []).append(self.global_ranks[r])
            raise HorovodInternalError(
                "ranks called split() (add_process_set) with different rank lists: "
                + "; ".join(f"ranks {who} asked for {lst}" for lst, who in by.items())
                + ". Every rank must add the same process sets in the same order.")
        if len(set(ranks)) != len(ranks) or any(r not in self.global_ranks for r in ranks):
            raise ValueError(f"process set ranks {ranks} must be distinct members of "
                             f"{self.global_ranks}")
        me = self.global_ranks[self.rank]
        if me not in ranks:
            return None
        child = TcpControlPlane(self.fabric, sid, ranks, me, self.timeout)
        child.connect_initial()
        return child

    def abort(self, reason: str = "") -> None:
        if self.fabric is not None:
            self.fabric.abort(reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._owner and self.fabric is not None:
            self.fabric.close()


def small_allreduce(plane: TcpControlPlane, buf: np.ndarray, ufunc: Any, op: int,
                    op_out: int) -> None:
    """In-place allreduce of a small contiguous array: one exchange at two ranks, else reduce
    at rank 0 in rank order (deterministic) and send the result back (two hops)."""
    n, r = plane.size, plane.rank
    raw = buf.reshape(-1).view(np.uint8).data
    nb = raw.nbytes
    if n == 2:
        link = plane.link(1 - r)
        link.send_msg(op, raw)
        other = link.recv_msg(op, nb)
        link.flush()
        # Commutative ops give both ranks the same bits.
        ufunc(buf, np.frombuffer(other, dtype=buf.dtype).reshape(buf.shape), out=buf)
        return
    if r == 0:
        links = [plane.link(p) for p in range(1, n)]
        for link in links:
            other = link.recv_msg(op, nb)
            ufunc(buf, np.frombuffer(other, dtype=buf.dtype).reshape(buf.shape), out=buf)
        for link in links:
            link.send_msg(op_out, raw)
        for link in links:
            link.flush()
    else:
        link = plane.link(0)
        link.send_msg(op, raw)
        link.recv_msg(op_out, nb, into=raw)
        link.flush()


# -- rendezvous ---------------------------------------------------------------------------------
class _Job:
    """Who this process is in the tcp world and where the rendezvous store lives."""

    def __init__(self, rank: int, size: int, kv_addr: str, kv_port: int, secret: bytes,
                 serve: bool, style: str) -> None:
        self.rank, self.size, self.kv_addr, self.kv_port = rank, size, kv_addr, kv_port
        self.secret, self.serve, self.style = secret, serve, style


def _secret(text: str) -> bytes:
    text = text.strip()
    if not text:
        return b""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def resolve_job(config: Any) -> _Job:
    """Reads rank, size, the rendezvous address and the secret from `config`.

    Raises:
        ValueError: the variables are inconsistent, naming the missing ones.
    """
    secret = _secret(config.secret_key)
    if config.rank >= 0 and config.size > 0 and config.rendezvous_addr:
        if config.rendezvous_port <= 0:
            raise ValueError("HOROVOD_GLOO_RENDEZVOUS_ADDR is set but "
                             "HOROVOD_GLOO_RENDEZVOUS_PORT is not; start the job with hvdrun")
        if not config.rank < config.size:
            raise ValueError(f"HOROVOD_RANK={config.rank} is not below "
                             f"HOROVOD_SIZE={config.size}")
        return _Job(config.rank, config.size, config.rendezvous_addr, config.rendezvous_port,
                    secret, False, "hvdrun")
    if config.env_world_size > 0 and config.env_rank >= 0 and config.master_addr:
        if config.master_port <= 0 and config.rendezvous_port <= 0:
            raise ValueError("MASTER_ADDR is set but MASTER_PORT is not (torchrun sets both)")
        if not config.env_rank < config.env_world_size:
            raise ValueError(f"RANK={config.env_rank} is not below "
                             f"WORLD_SIZE={config.env_world_size}")
        port = config.rendezvous_port or config.master_port + 1
        return _Job(config.env_rank, config.env_world_size, config.master_addr, port, secret,
                    config.env_rank == 0, "torchrun")
    if config.size > 1 or config.rendezvous_addr:
        raise ValueError(
            "tcp mode needs HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_GLOO_RENDEZVOUS_ADDR and "
            "HOROVOD_GLOO_RENDEZVOUS_PORT (hvdrun --tcp sets them), or RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT (torchrun); some are missing")
    return _Job(0, 1, "", 0, secret, False, "single")


def _iface_ip(iface: str) -> str:
    try:
        ipaddress.ip_address(iface)
        return iface
    except ValueError:
        pass
    try:
        import fcntl  # Unix only; needed only to look an interface up by name
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", iface.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError) as exc:
        raise ValueError(f"HOROVOD_GLOO_IFACE={iface!r}: no IPv4 address on that interface "
                         f"({exc}); name an interface of this host (see `ip addr`)") from None


def _job_ip(config: Any, kv_addr: str, kv_port: int) -> str:
    """The address of this host on the job's network: the named interface, else the one that
    routes to the rendezvous server."""
    if config.gloo_iface:
        return _iface_ip(config.gloo_iface)
    try:
        ip = socket.gethostbyname(kv_addr)
    except OSError as exc:
        raise ValueError(f"cannot resolve the rendezvous host {kv_addr!r}: {exc}") from None
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, kv_port or 9))  # no packet is sent; picks the route's source address
        return s.getsockname()[0]


def _serve(job: _Job, timeout: float) -> KVServer:
    """Rank 0 under torchrun: the store, bound to MASTER_ADDR's address on this host."""
    host = socket.gethostbyname(job.kv_addr)
    deadline = time.monotonic() + timeout
    while True:
        server = KVServer(host, job.kv_port, job.secret)
        try:
            server.start()
            return server
        except OSError as exc:
            if exc.errno == 99 and host != "0.0.0.0":  # EADDRNOTAVAIL: not our address
                if not job.secret:
                    # Unauthenticated, on every interface: anyone who can reach any of them
                    # could join the job and feed broadcast_object a pickle.
                    raise HorovodInternalError(
                        f"MASTER_ADDR {job.kv_addr} ({host}) is not an address of rank 0's "
                        "host, and this job has no secret (HOROVOD_SECRET_KEY), so the tcp "
                        "rendezvous will not listen on all interfaces instead: set MASTER_ADDR "
                        "to an address of this host, or give every rank the same "
                        "HOROVOD_SECRET_KEY (e.g. from `python -c \"import secrets; "
                        "print(secrets.token_hex(32))\"`)") from exc
                get_logger().warning(
                    "MASTER_ADDR %s is not an address of this host; the tcp rendezvous "
                    "server listens on all interfaces instead (connections are "
                    "authenticated with the job's secret)", job.kv_addr)
                host = "0.0.0.0"
                continue
            if time.monotonic() > deadline:
                raise HorovodInternalError(
                    f"rank 0 cannot serve the tcp rendezvous on {host}:{job.kv_port} "
                    f"({exc}). That port is MASTER_PORT+1 by default; pick a free one with "
                    "HOROVOD_GLOO_RENDEZVOUS_PORT.") from exc
            time.sleep(0.1)  # the previous init's server may still be closing


UNAUTHENTICATED_WARNING = (
    "tcp mode runs without a job secret (HOROVOD_SECRET_KEY is not set): connections are "
    "not authenticated, so any process that can reach {addr}:{port} or a rank's listener "
    "(any local user, on loopback) can join this job as a rank, and broadcast_object/"
    "allgather_object would unpickle what it sends. Set the same HOROVOD_SECRET_KEY (hex, e.g. "
    "`python -c 'import secrets; print(secrets.token_hex(32))'`) on every rank, or launch "
    "with hvdrun.")
_warned_unauthenticated = False


def _warn_unauthenticated(job: _Job) -> None:
    """Rank 0 says once per process that the job is not authenticated."""
    global _warned_unauthenticated
    if job.rank != 0 or _warned_unauthenticated:
        return
    _warned_unauthenticated = True
    get_logger().warning(UNAUTHENTICATED_WARNING.format(addr=job.kv_addr, port=job.kv_port))


def create_backend(config: Any, comm: Any = None, scope: str | None = None,
                   **_: Any) -> TcpControlPlane:
    """The world's control plane of the tcp mode (see the module docstring).

    Args:
        config: the `Config` read at init.
        comm: ignored (the registry passes it to every backend).
        scope: key prefix in the rendezvous store; elastic drivers pass one per round so that
            processes of different rounds never meet.

    Raises:
        ValueError: the environment is inconsistent.
        CollectiveTimeoutError: a rank did not show up within HOROVOD_GLOO_TIMEOUT_SECONDS.
        HorovodInternalError: authentication or a connection failed.
    """
    job = resolve_job(config)
    timeout = config.gloo_timeout if config.gloo_timeout > 0 else 30.0
    if job.size == 1:
        return TcpControlPlane(None, "w", [0], 0, timeout, owner=True)
    log = get_logger()
    gen = next(_INITS)
    scope = scope or f"ringvod/tcp/{gen}"
    bind_ip = _job_ip(config, job.kv_addr, job.kv_port)
    if not job.secret:
        _warn_unauthenticated(job)
    server = _serve(job, timeout) if job.serve else None
    fabric = Fabric(job.rank, job.secret, timeout, bind_ip)
    kv = KVClient(job.kv_addr, job.kv_port, job.secret, timeout)
    plane = None
    try:
        me = fabric.start(config.hostname or socket.gethostname())
        deadline = time.monotonic() + timeout
        kv.put(scope, f"addr.{job.rank}", json.dumps(me.to_json()).encode())
        if job.rank == 0:
            peers = [json.loads(kv.get(scope, f"addr.{r}",
                                       max(deadline - time.monotonic(), 0.0)))
                     for r in range(job.size)]
            kv.put(scope, "table", json.dumps({"session": os.urandom(8).hex(),
                                               "peers": peers}).encode())
        table = json.loads(kv.get(scope, "table", max(deadline - time.monotonic(), 0.0)))
        fabric.set_table(table["session"], [PeerInfo.from_json(p) for p in table["peers"]])
        plane = TcpControlPlane(fabric, "w", list(range(job.size)), job.rank, timeout,
                                owner=True)
        plane.connect_initial()
        plane.barrier()
        if job.style == "hvdrun":  # the launcher's store outlives us: leave it clean
            kv.delete(scope, f"addr.{job.rank}")
            if job.rank == 0:
                kv.delete(scope, "table")  # everyone read it before the barrier
        log.debug("tcp mode: rank %d of %d ready (%s)", job.rank, job.size, job.style)
    except BaseException:
        if plane is not None:
            plane.close()
        else:
            fabric.close()
        if server is not None:
            server.stop()
        raise
    finally:
        kv.close()
    if server is not None:
        # Past the barrier no rank uses the store; a re-init starts a fresh one.
        server.stop()
    return plane

