"""The tcp control plane and data engine directly, in real processes over real sockets.

The test process plays hvdrun: it runs a `KVServer` and starts each rank as a process (the
harness's `run_procs`) that runs a scenario of this file (`test_tcp_plane.py --worker
<scenario> <rank> <size> <port>`). Every run has a hard timeout; on failure or timeout every
rank's output (with a faulthandler dump of hung ranks) is printed.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from collective.config import read_env  # noqa: E402
from collective.errors import CollectiveTimeoutError, HorovodInternalError  # noqa: E402
from collective.rendezvous import KVServer  # noqa: E402
from collective.types import ReduceOp  # noqa: E402
from tests._spmd import run_procs  # noqa: E402

SECRET = "5ec12e7" + "0" * 57


# -- driver ------------------------------------------------------------------------------------
def _run_scenario(scenario: str, n: int, timeout: float = 60.0, gloo_timeout: float = 10.0,
                  expect_rc: dict[int, int] | None = None,
                  env: dict[str, str] | None = None) -> list[str]:
    """Runs `scenario` on `n` ranks against a store of this process; returns each rank's
    output. Fails (printing every rank's output) on a timeout or an unexpected exit code."""
    server = KVServer("127.0.0.1", 0, bytes.fromhex(SECRET))
    _, port = server.start()
    try:
        res = run_procs(n, script=__file__, timeout=timeout, expect_rc=expect_rc,
                        args=["--worker", scenario, "{rank}", str(n), str(port)],
                        env=dict({"GLOO_TEST_TIMEOUT": str(gloo_timeout),
                                  "TCP_TEST_TRANSPORT": "shm"}, **(env or {})))
    finally:
        server.stop()
    return res.outputs


def _plane(rank: int, size: int, port: int, secret: str = SECRET):
    from collective.engines.tcp import net as tcp_net, plane as tcp, ring as tcp_ring, shm as tcp_shm
    transport = os.environ.get("TCP_TEST_TRANSPORT", "shm")
    tcp_net.UNIX_SOCKETS = transport != "tcp"
    tcp_shm.ENABLED = tcp_shm.ENABLED and transport in ("shm", "ring")
    tcp_shm.CMA = tcp_shm.CMA and transport == "shm"
    cfg = read_env({}, rank=rank, size=size, rendezvous_addr="127.0.0.1",
                   rendezvous_port=port, secret_key=secret,
                   gloo_timeout=float(os.environ["GLOO_TEST_TIMEOUT"]))
    plane = tcp.create_backend(cfg)
    return plane, tcp_ring.create_engine(plane, cfg)


# -- scenarios (run inside the ranks) ----------------------------------------------------------
def scenario_ops(rank: int, size: int, port: int) -> None:
    plane, eng = _plane(rank, size, port)
    assert (plane.rank, plane.size) == (rank, size)
    if size > 1:
        from collective.engines.tcp import cma as tcp_cma
        from collective.engines.tcp.shm import ShmLink
        link = plane.link((rank + 1) % size)
        transport = os.environ["TCP_TEST_TRANSPORT"]
        want = socket.AF_INET if transport == "tcp" else socket.AF_UNIX
        assert link.sock.family == want, link.sock
        assert isinstance(link, ShmLink) == (transport in ("shm", "ring")), link
        assert link.zero_copy == (transport == "shm" and tcp_cma.available()), link
    g = plane.gather(b"r%d" % rank)
    assert g == ([b"r%d" % i for i in range(size)] if rank == 0 else None), g
    assert plane.bcast(b"hi" * 40000 if rank == 0 else None) == b"hi" * 40000
    w = plane.allreduce_words(np.array([1 << rank, 0xFF, 1 << 63], np.uint64), "or")
    assert w.tolist() == [(1 << size) - 1, 0xFF, 1 << 63]
    w = plane.allreduce_words(np.array([(1 << rank) | 1, 0xFF], np.uint64), "and")
    assert w.tolist() == [1 if size > 1 else 1 | (1 << rank), 0xFF]
    assert plane.allgather(b"x" * (rank * 100000)) == [b"x" * (i * 100000) for i in range(size)]
    plane.barrier()
    rng = np.random.default_rng(7)
    for n in (1, 5, 4096, 100_003, 1_500_001):
        for dt in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
            base = rng.integers(0, 5, size=(size, n)).astype(dt)
            for op, ref in ((ReduceOp.SUM, base.sum(0, dtype=dt)), (ReduceOp.MIN, base.min(0)),
                            (ReduceOp.MAX, base.max(0)), (ReduceOp.PRODUCT,
                                                          base.prod(0, dtype=dt))):
                if n > 5000 and op in (ReduceOp.MIN, ReduceOp.PRODUCT):
                    continue  # large sizes exercise the ring once per dtype is enough
                a = base[rank].copy()
                eng._allreduce(a, op)
                assert np.array_equal(a, ref.astype(dt)), (n, dt, op)
    for total in (3, 70_000, 3_000_000):
        counts = [total // size + (r % 2) * 13 for r in range(size)]
        send = np.full(counts[rank], rank + 1, np.uint8)
        recv = np.zeros(sum(counts), np.uint8)
        eng._allgatherv(send, recv, counts)
        assert np.array_equal(recv, np.repeat(np.arange(1, size + 1, dtype=np.uint8), counts))
    for nb in (0, 10, 100_000, 5_000_000):
        for root in range(size):
            b = np.full(nb, rank, np.uint8)
            eng._broadcast(b, root)
            assert (b == root).all(), (nb, root)
    for n in (7, 1_000_003):
        counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
        full = np.stack([np.arange(n, dtype=np.float64) * (r + 1) for r in range(size)])
        recv = np.empty(counts[rank])
        eng._reduce_scatter(full[rank].copy(), recv, counts, ReduceOp.SUM)
        off = sum(counts[:rank])
        assert np.allclose(recv, full.sum(0)[off:off + counts[rank]]), n
    for m in (0, 3, 300_000):
        sc = [m * (rank + 1) + d for d in range(size)]
        send = np.concatenate([np.full(c, 10 * rank + d, np.uint8) for d, c in enumerate(sc)]
                              ) if sum(sc) else np.zeros(0, np.uint8)
        rc = [m * (s + 1) + rank for s in range(size)]
        recv = np.empty(sum(rc), np.uint8)
        eng._alltoallv(send, sc, recv, rc)
        exp = np.concatenate([np.full(c, 10 * s + rank, np.uint8) for s, c in enumerate(rc)])
        assert np.array_equal(recv, exp), m
    eng._barrier()
    eng.close()
    plane.close()


def scenario_small_socket_buffers(rank: int, size: int, port: int) -> None:
    # Socket buffers smaller than a chunk (a stock net.core.wmem_max, or a plain Unix link):
    # two ranks each waited for their own chunk to leave before reading the other's.
    from collective.engines.tcp import net as tcp_net
    tcp_net.SOCK_BUF = 64 << 10
    plane, eng = _plane(rank, size, port)
    a = np.full(1 << 20, rank + 1.0, np.float32)  # 4 MiB, eight chunks
    eng._allreduce(a, ReduceOp.SUM)
    assert (a == sum(range(1, size + 1))).all()
    eng.close()
    plane.close()


def scenario_alltoall_many(rank: int, size: int, port: int) -> None:
    # Links opened in the alltoall's own order waited for each other in cycles from 6 ranks
    # of a host (3 apart: 1 -> 4 -> 1 ..., 2 apart: 1 -> 3 -> 5 -> 1).
    plane, eng = _plane(rank, size, port)
    sc = [rank + d + 1 for d in range(size)]
    send = np.concatenate([np.full(c, 10 * rank + d, np.int32) for d, c in enumerate(sc)])
    rc = [s + rank + 1 for s in range(size)]
    recv = np.empty(sum(rc), np.int32)
    eng._alltoallv(send, sc, recv, rc)
    exp = np.concatenate([np.full(c, 10 * s + rank, np.int32) for s, c in enumerate(rc)])
    assert np.array_equal(recv, exp)
    eng.close()
    plane.close()


def scenario_split(rank: int, size: int, port: int) -> None:
    from collective.engines.tcp.ring import create_engine
    plane, _ = _plane(rank, size, port)
    evens = [r for r in range(size) if r % 2 == 0]
    odds_rev = [r for r in reversed(range(size)) if r % 2 == 1]
    subs = [plane.split(evens), plane.split(odds_rev), plane.split(list(range(size)))]
    for ranks, sub in zip((evens, odds_rev, list(range(size))), subs):
        if rank not in ranks:
            assert sub is None
            continue
        assert sub.size == len(ranks) and sub.global_ranks == ranks
        assert sub.rank == ranks.index(rank)
        got = sub.allgather(str(rank).encode())
        assert got == [str(r).encode() for r in ranks], got
        eng = create_engine(sub, _cfg_stub())
        a = np.full(300_000, rank, np.int64)
        eng._allreduce(a, ReduceOp.SUM)
        assert (a == sum(ranks)).all()
    plane.barrier()  # the world plane still works after the splits
    for sub in subs:
        if sub is not None:
            sub.close()
    plane.close()


def _cfg_stub():
    return read_env({}, fusion_threshold=1 << 20)


def scenario_kill(rank: int, size: int, port: int) -> None:
    """The last rank SIGKILLs itself in the middle of a stream of large allreduces."""
    plane, eng = _plane(rank, size, port)
    victim = size - 1
    if rank == victim:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    a = np.ones(8 << 20, np.float32)
    t_kill = time.monotonic() + 0.5
    try:
        for _ in range(100_000):
            eng._allreduce(a, ReduceOp.SUM)
    except HorovodInternalError as exc:
        waited = time.monotonic() - t_kill
        print(f"rank {rank}: got {type(exc).__name__} after {waited:.2f} s: {exc}", flush=True)
        assert not isinstance(exc, CollectiveTimeoutError), exc  # EOF, not the 30 s timeout
        assert waited < 10, waited
        with pytest.raises(HorovodInternalError):  # the plane stays failed
            plane.barrier()
        plane.close()
        return
    raise AssertionError("the allreduces kept working after a peer died")


def scenario_stop(rank: int, size: int, port: int) -> None:
    """Rank 1 freezes (SIGSTOP): rank 0 gets CollectiveTimeoutError after the gloo timeout."""
    plane, _ = _plane(rank, size, port)
    pids = [int(p) for p in plane.allgather(str(os.getpid()).encode())]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        plane.allreduce_words(np.zeros(2, np.uint64), "and")
    waited = time.monotonic() - t0
    print(f"rank 0: timed out after {waited:.2f} s: {info.value}", flush=True)
    assert 1.5 < waited < 6, waited
    assert "rank 1" in str(info.value) and "HOROVOD_GLOO_TIMEOUT_SECONDS" in str(info.value)
    plane.close()
    os.kill(pids[1], signal.SIGKILL)


def scenario_abort_idle(rank: int, size: int, port: int) -> None:
    """A rank blocked on a slow peer burns no CPU, and abort() from another thread frees it."""
    plane, _ = _plane(rank, size, port)
    if rank == 1:
        time.sleep(3.0)  # rank 0 waits for us, then aborts
        with pytest.raises(HorovodInternalError):
            plane.allreduce_words(np.zeros(2, np.uint64), "and")
        plane.close()
        return
    threading.Timer(1.5, plane.abort, ("test abort",)).start()
    cpu0, t0 = time.process_time(), time.monotonic()
    with pytest.raises(HorovodInternalError, match="test abort"):
        plane.allreduce_words(np.zeros(2, np.uint64), "and")
    waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
    print(f"rank 0: aborted after {waited:.2f} s, {cpu:.3f} s CPU", flush=True)
    assert 1.2 < waited < 3.0, waited
    assert cpu < 0.3, cpu  # blocked in the kernel, not spinning
    with pytest.raises(HorovodInternalError):
        plane.barrier()  # fails fast after abort
    plane.close()


def scenario_wrong_secret(rank: int, size: int, port: int) -> None:
    """Rank 1 has a different secret: the rendezvous server refuses it."""
    if rank == 1:
        with pytest.raises(HorovodInternalError, match="refused authentication"):
            _plane(rank, size, port, secret="ff" * 32)
        return
    with pytest.raises(CollectiveTimeoutError, match="addr.1"):
        _plane(rank, size, port)


def scenario_reinit(rank: int, size: int, port: int) -> None:
    for i in range(3):
        plane, eng = _plane(rank, size, port)
        a = np.full(200_000, rank + i, np.float64)
        eng._allreduce(a, ReduceOp.SUM)
        assert (a == sum(range(size)) + i * size).all()
        eng.close()
        plane.close()


def scenario_torchrun(rank: int, size: int, port: int) -> None:
    """torchrun-style variables; rank 0 serves the store on MASTER_PORT + 1."""
    from collective.engines.tcp.plane import create_backend
    from collective.engines.tcp.ring import create_engine
    cfg = read_env({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": os.environ["TORCHRUN_PORT"], "LOCAL_RANK": str(rank),
                    "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"})
    for _ in range(2):  # init -> shutdown -> init
        plane = create_backend(cfg)
        eng = create_engine(plane, cfg)
        a = np.full(100_000, rank, np.int32)
        eng._allreduce(a, ReduceOp.SUM)
        assert (a == sum(range(size))).all()
        plane.close()


# -- tests (pytest side) -----------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,transport", [(1, "shm"), (2, "shm"), (4, "shm"), (2, "ring"),
                                         (3, "ring"), (2, "unix"), (3, "tcp")])
def test_primitives_match_numpy(n: int, transport: str) -> None:
    """Ranks of a host: reading each other's memory (shm: cross-memory attach), shared-memory
    rings (ring), plain Unix sockets (unix); ranks of different hosts: TCP."""
    _run_scenario("ops", n, timeout=200, env={"TCP_TEST_TRANSPORT": transport})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_two_ranks_with_small_socket_buffers(transport: str) -> None:
    _run_scenario("small_socket_buffers", 2, timeout=90, env={"TCP_TEST_TRANSPORT": transport})


@pytest.mark.timeout(120)
def test_alltoall_among_six_ranks_of_a_host() -> None:
    _run_scenario("alltoall_many", 6, timeout=90, env={"TCP_TEST_TRANSPORT": "unix"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_split(n: int) -> None:
    _run_scenario("split", n, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,transport", [(2, "shm"), (4, "shm"), (3, "ring"), (3, "tcp")])
def test_sigkill_mid_allreduce_raises_on_survivors(n: int, transport: str) -> None:
    outs = _run_scenario("kill", n, timeout=90, gloo_timeout=30.0,
                     expect_rc={n - 1: -signal.SIGKILL}, env={"TCP_TEST_TRANSPORT": transport})
    for r in range(n - 1):
        assert "HorovodInternalError" in outs[r], outs[r]
    # The dead rank's neighbours name it; the others may see the cascade first.
    assert any(f"connection to rank {n - 1} " in o for o in outs[:-1]), outs


@pytest.mark.timeout(60)
def test_frozen_peer_times_out() -> None:
    outs = _run_scenario("stop", 2, timeout=30, gloo_timeout=2.0, expect_rc={1: -signal.SIGKILL})
    assert "timed out" in outs[0]


@pytest.mark.timeout(60)
def test_abort_unblocks_without_spinning() -> None:
    _run_scenario("abort_idle", 2, timeout=40, gloo_timeout=20.0)


@pytest.mark.timeout(60)
def test_wrong_secret_is_refused() -> None:
    _run_scenario("wrong_secret", 2, timeout=40, gloo_timeout=3.0)


@pytest.mark.timeout(90)
def test_reinit() -> None:
    _run_scenario("reinit", 2, timeout=60)


@pytest.mark.timeout(90)
def test_torchrun_style_env() -> None:
    with socket.socket() as s:  # a free pair of ports: MASTER_PORT (unused) and +1
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
    _run_scenario("torchrun", 2, timeout=60, env={"TORCHRUN_PORT": str(p - 1 if p > 1025 else p)})


def test_unauthenticated_peer_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A connection to a rank's listener without the secret is logged and dropped."""
    from collective.engines.tcp.net import Fabric
    from collective.auth import handshake_client
    import logging
    fab = Fabric(0, b"right", 5.0, "127.0.0.1", use_unix=False)
    me = fab.start("localhost")
    logger = logging.getLogger("horovod")
    logger.addHandler(caplog.handler)
    try:
        with socket.create_connection(("127.0.0.1", me.port), timeout=5) as s:
            with pytest.raises(HorovodInternalError, match="refused"):
                handshake_client(s, b"wrong", b"RVODPR01", b"x/w/1", 5.0, "rank 0")
        with socket.create_connection(("127.0.0.1", me.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"A" * 5000)  # garbage: dropped, no crash
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        # Wait for two distinct peers, not two lines: until logging is configured the
        # `horovod` logger propagates, so caplog may hold each record twice.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(_refused_peers(caplog.text)) < 2:
            time.sleep(0.05)
    finally:
        logger.removeHandler(caplog.handler)
        fab.close()
    assert len(_refused_peers(caplog.text)) == 2, caplog.text  # both, each naming its address


def _refused_peers(text: str) -> set[str]:
    return set(re.findall(r"refused a connection from (127\.0\.0\.1:\d+)", text))


# A same-host peer that lies in its link hello: it announces the pid of another process (the
# test process) and the address of a token there, which that process does hold.
_LYING_PEER = r"""
import ctypes, os, socket, struct, sys, time
name, token = sys.argv[1], sys.argv[4]
pid, addr, size = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
if token == "own":  # a token in this process's memory, announced with a wrong pid
    mine = ctypes.create_string_buffer(os.urandom(16), 16)
    addr, token = ctypes.addressof(mine), mine.raw.hex()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + name)
ring = os.memfd_create("fake-ring")
os.ftruncate(ring, size)
a, b = socket.socketpair()
hello = struct.pack("<cQQ16s", b"Y", pid, addr, bytes.fromhex(token))
socket.send_fds(s, [hello], [ring, b.fileno()])
socket.recv_fds(s, 33, 2)
s.sendall(b"C")
s.recv(1)
time.sleep(60)  # hold the link until the test kills this process
"""


@pytest.mark.parametrize("token_in", ["announced-process", "peer"])
def test_shm_link_reads_only_from_the_pid_at_the_other_end(token_in: str) -> None:
    """In-place reads (process_vm_readv) go to the process the kernel reports at the other end
    of the socket (SO_PEERCRED), never to the pid a peer announces: a peer that announces this
    process's pid and an address of a token here gets no reads of this process (the rings
    instead); a peer whose token is in its own memory is read there, whatever pid it
    announced (a pid of another namespace, say)."""
    import ctypes
    import subprocess
    from collective.engines.tcp import cma, shm
    from collective.engines.tcp.net import Fabric
    if not (shm.ENABLED and shm.CMA and hasattr(socket, "SO_PEERCRED")):
        pytest.skip("needs memfd, SCM_RIGHTS, process_vm_readv and SO_PEERCRED (Linux)")
    token = ctypes.create_string_buffer(os.urandom(16), 16)
    here = ctypes.addressof(token)
    assert cma.probe(os.getpid(), here, token.raw)  # the lie would pass the token check alone
    name = f"ringvod-test-{os.getpid()}-{os.urandom(4).hex()}"  # abstract: bound as "\0" + name
    fab = Fabric(1, b"", 10.0, "127.0.0.1")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lst:
        lst.bind("\0" + name)
        lst.listen(1)
        peer = subprocess.Popen([sys.executable, "-c", _LYING_PEER, name, str(os.getpid()),
                                 str(here), token.raw.hex() if token_in != "peer" else "own",
                                 str(shm.RING + shm._CTL)])
        try:
            lst.settimeout(20)
            sock, _ = lst.accept()
            link = shm.make_link(fab, sock, 0, 0, "test")
            assert isinstance(link, shm.ShmLink)  # the rings are fine: they hold no pid
            if token_in == "peer":
                assert link.peer_pid == peer.pid and link.zero_copy
            else:
                assert link.peer_pid == 0 and not link.zero_copy
            link.close()
        finally:
            peer.kill()
            peer.wait()
            fab.close()


# -- worker entry point ------------------------------------------------------------------------
def _worker(argv: list[str]) -> None:
    scenario, rank, size, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    globals()[f"scenario_{scenario}"](rank, size, port)
    print(f"rank {rank}: scenario {scenario} passed", flush=True)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--worker":
    _worker(sys.argv[2:])


def test_rendezvous_on_every_interface_only_with_a_secret():
    # torchrun style, MASTER_ADDR not an address of rank 0's host: listening on all interfaces
    # without a secret would let anyone who reaches one join the job (and feed broadcast_object
    # a pickle); with the job's secret, connections are authenticated.
    import socket

    from collective.engines.tcp import plane
    from collective.errors import HorovodInternalError
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    foreign = "192.0.2.1"  # TEST-NET-1: never an address of this host
    job = plane._Job(0, 2, foreign, port, b"", True, "torchrun")
    with pytest.raises(HorovodInternalError, match="is not an address of rank 0's host, and "
                                                   "this job has no secret"):
        plane._serve(job, timeout=5)
    server = plane._serve(plane._Job(0, 2, foreign, port, b"k" * 32, True, "torchrun"), 5)
    try:
        assert server.host == "0.0.0.0"
    finally:
        server.stop()
