"""Adversarial tests of the tcp mode over loopback: nothing a peer sends runs as code, and
pre-authentication work is bounded (whole-handshake deadline, capped pending connections,
throttled refusal logs), so a flood neither stops a real init nor the running job.

Every process here is real and every socket is on 127.0.0.1; each test is bounded in time.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from tests._spmd import run_procs

pytestmark = [pytest.mark.tcp]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. an unauthenticated job: a rank that sends a pickle cannot run code ---------------------
_VICTIM = r"""
import sys, time, numpy as np
import collective as hvd
try:
    hvd.init()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        hvd.allreduce(np.ones(4, np.float32), name="x")
    print("VICTIM: no error", flush=True)
    sys.exit(3)
except Exception as exc:
    print(f"VICTIM: refused: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(0)
"""

_ATTACKER = r"""
import builtins, os, pickle, sys
import numpy as np
import collective as hvd
import collective.coordinator.negotiate as co
from collective.engines.tcp import plane as tcp

class Evil:
    def __reduce__(self):
        return (builtins.open, (os.environ["PWNED"], "w"))

payload = pickle.dumps(Evil())
where = os.environ["ATTACK_AT"]
if where == "topology":  # the first control-plane message: the host name exchange
    orig = tcp.TcpControlPlane.allgather
    def allgather(self, data):
        return orig(self, payload)
    tcp.TcpControlPlane.allgather = allgather
else:  # the slow path of negotiation: the request list
    co.encode_requests = lambda reqs, shutdown: payload
try:
    hvd.init()
    hvd.allreduce(np.ones(4, np.float32), name="x")
except Exception as exc:
    print(f"ATTACKER: {type(exc).__name__}: {exc}", flush=True)
"""


@pytest.mark.spmd_driver
@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["topology", "negotiation"])
def test_pickle_from_an_unauthenticated_rank_does_not_run(where: str, tmp_path) -> None:
    pwned = tmp_path / "pwned"
    port = _free_port()

    def env_of(r: int) -> dict[str, str]:
        return dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port - 1), HOROVOD_GLOO_TIMEOUT_SECONDS="10",
                    PWNED=str(pwned), ATTACK_AT=where)

    script = (f"import os\nV = {_VICTIM!r}\nA = {_ATTACKER!r}\n"
              "exec(V if os.environ['RANK'] == '0' else A)\n")
    res = run_procs(2, code=script, env=env_of, timeout=45, check=False)
    assert not pwned.exists(), "the attacker's pickle ran inside rank 0\n" + res.report()
    rc, out = res.returncodes[0], res.outputs[0]
    assert rc == 0 and "VICTIM: refused" in out, res.report()
    assert "malformed" in out and "rank 1" in out, res.report()
    # rank 0 said, once, that the job is not authenticated
    assert out.count("without a job secret") == 1, res.report()


# -- 4. pre-authentication limits ---------------------------------------------------------------
@pytest.fixture
def log(caplog: pytest.LogCaptureFixture):
    """The `horovod` logger does not propagate to the root logger: attach caplog directly."""
    logger = logging.getLogger("horovod")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)


def _slowloris(port: int, magic_len: int, interval: float, limit: float) -> float:
    """Reads the greeting, then sends one byte every `interval`; returns when the server hung
    up (seconds after the greeting), or `limit` if it never did."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        got = b""
        while len(got) < magic_len + 32:
            got += s.recv(64)
        t0 = time.monotonic()
        s.settimeout(interval)
        while time.monotonic() - t0 < limit:
            try:
                s.sendall(b"\x00")
                if s.recv(1) == b"":
                    return time.monotonic() - t0
            except socket.timeout:
                continue
            except OSError:
                return time.monotonic() - t0
    return limit


@pytest.mark.timeout(30)
def test_slowloris_is_cut_at_the_handshake_deadline() -> None:
    from collective.engines.tcp.net import Fabric
    from collective.rendezvous import KVServer
    srv = KVServer("127.0.0.1", 0, b"s" * 32)
    srv.handshake_timeout = 1.0
    _, port = srv.start()
    fab = Fabric(0, b"s" * 32, 1.0, "127.0.0.1", use_unix=False)
    me = fab.start("localhost")
    try:
        # 34 bytes would take 10 s at 0.3 s each; the deadline is for the whole handshake
        for p in (port, me.port):
            held = _slowloris(p, 8, 0.3, 6.0)
            assert held < 2.5, f"a byte every 0.3 s held a connection to port {p} {held:.1f} s"
    finally:
        srv.stop()
        fab.close()


class _Flood:
    """Holds `hold` silent connections to `port` and keeps opening ones that send garbage."""

    def __init__(self, port: int, hold: int) -> None:
        self.port, self.stop, self.opened = port, threading.Event(), 0
        self.held = []
        for _ in range(hold):
            try:
                self.held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(os.urandom(40) + b"\x00\x10" + os.urandom(64))
                self.opened += 1
            except OSError:
                time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.held:
            s.close()


def _warnings(log) -> list[str]:
    seen, out = set(), []
    for r in log.records:  # a record may reach caplog through two handlers
        if r.levelno >= logging.WARNING and id(r) not in seen:
            seen.add(id(r))
            out.append(r.getMessage())
    return out


@pytest.mark.timeout(60)
def test_store_flood_does_not_lock_out_real_clients(log) -> None:
    from collective.auth import MAX_PENDING
    from collective.rendezvous import KVClient, KVServer
    secret = os.urandom(32)
    srv = KVServer("127.0.0.1", 0, secret)
    srv.handshake_timeout = 2.0
    _, port = srv.start()
    flood = _Flood(port, 2 * MAX_PENDING)
    try:
        t0 = time.monotonic()
        i, slowest = 0, 0.0
        while i < 20 or time.monotonic() - t0 < 2.5:  # a fresh handshake each time
            t1 = time.monotonic()
            with KVClient("127.0.0.1", port, secret, timeout=10) as c:
                c.put("s", f"k{i}", b"v")
                assert c.get("s", f"k{i}", timeout=5) == b"v"
            slowest = max(slowest, time.monotonic() - t1)
            i += 1
        time.sleep(0.5)
        assert srv._gate.pending <= MAX_PENDING
    finally:
        flood.close()
        srv.stop()
    assert flood.opened > 20, flood.opened
    assert slowest < 5, slowest
    lines = _warnings(log)
    # summarised: a few lines naming peers, then one summary per window, not one per connection
    assert len(lines) <= 6, f"{len(lines)} warnings for {flood.opened} connections: {lines[:8]}"
    assert any("more connection(s)" in m for m in lines), lines


@pytest.mark.timeout(60)
def test_worker_listener_flood_does_not_stop_connections(log) -> None:
    from collective.engines.tcp.net import Fabric
    from collective.auth import MAX_PENDING
    secret = os.urandom(32)
    fabs = [Fabric(r, secret, 10.0, "127.0.0.1", use_unix=False) for r in range(2)]
    infos = [f.start("localhost") for f in fabs]
    for f in fabs:
        f.set_table("sess", infos)
    flood = _Flood(infos[0].port, 2 * MAX_PENDING)
    try:
        t0, i = time.monotonic(), 0
        while i < 10 or time.monotonic() - t0 < 2.5:
            i += 1
            deadline = time.monotonic() + 10
            out: list = []
            t = threading.Thread(target=lambda: out.append(fabs[1].connect(f"p{i}", 0, deadline)))
            t.start()
            inc = fabs[0].connect(f"p{i}", 1, deadline)
            t.join(10)
            out[0].sendall(b"ping")
            assert inc.recv(4) == b"ping"
            inc.close()
            out[0].close()
    finally:
        flood.close()
        for f in fabs:
            f.close()
    assert flood.opened > 20, flood.opened
    lines = _warnings(log)
    assert len(lines) <= 6, f"{len(lines)} warnings for {flood.opened} connections: {lines[:8]}"


# -- 5. a handshake that times out while dialling names the ranks and the address ---------------
@pytest.mark.timeout(30)
def test_dial_handshake_timeout_names_rank_peer_and_address() -> None:
    from collective.engines.tcp.net import Fabric, PeerInfo
    from collective.errors import CollectiveTimeoutError
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # accepts (the kernel does) but never answers the handshake
    port = mute.getsockname()[1]
    fab = Fabric(3, b"k" * 32, 1.5, "127.0.0.1", use_unix=False)
    me = fab.start("hostA")
    fab.set_table("s", [PeerInfo(1, "hostB", "127.0.0.1", port, "", ""), me])
    try:
        with pytest.raises(CollectiveTimeoutError) as ei:
            fab.connect("w", 1, time.monotonic() + 1.5)
    finally:
        fab.close()
        mute.close()
    msg = str(ei.value)
    for part in ("rank 3", "rank 1", f"127.0.0.1:{port}", "hostB", "HOROVOD_SECRET_KEY",
                 "log"):
        assert part in msg, msg


_FLOODED_JOB = r"""
import os, sys, time, numpy as np
import collective as hvd
from collective._current import current
for i in range(2):  # init -> work -> shutdown -> init under the flood
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        port = current().control.fabric.me.port
        with open(os.environ["PORT_FILE"] + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(os.environ["PORT_FILE"] + ".tmp", os.environ["PORT_FILE"])
        deadline = time.monotonic() + 20  # the steps must run while the flood goes on
        while i == 0 and not os.path.exists(os.environ["FLOOD_FILE"]):
            assert time.monotonic() < deadline, "the flood did not start"
            time.sleep(0.01)
    t0 = time.monotonic()
    for step in range(400):  # while the flood goes on
        out = hvd.allreduce(np.full(1000, r + 1.0, np.float32), op=hvd.Sum, name=f"s{step % 3}")
        assert (out == n * (n + 1) / 2).all()
    hvd.shutdown()
    print(f"rank {r} round {i}: 400 steps in {time.monotonic() - t0:.1f} s", flush=True)
print("FLOODED JOB OK", flush=True)
"""


@pytest.mark.spmd_driver
@pytest.mark.timeout(120)
def test_job_keeps_running_and_reinits_under_a_connection_flood(tmp_path) -> None:
    port = _free_port()
    port_file, flood_file = tmp_path / "port", tmp_path / "flooding"
    secret = os.urandom(32).hex()

    def env_of(r: int) -> dict[str, str]:
        return dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port - 1), HOROVOD_GLOO_TIMEOUT_SECONDS="30",
                    HOROVOD_SECRET_KEY=secret, PORT_FILE=str(port_file),
                    FLOOD_FILE=str(flood_file))

    floods = [_Flood(port, 0)]  # the store (MASTER_PORT + 1), while it exists
    stop = threading.Event()

    def listener_flood() -> None:  # rank 0's worker listener, once it is known
        while not stop.is_set() and not port_file.exists():
            time.sleep(0.05)
        if not stop.is_set():
            flood = _Flood(int(port_file.read_text()), 100)
            floods.append(flood)
            deadline = time.monotonic() + 10
            while flood.opened <= 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            flood_file.write_text("on")  # rank 0 starts its steps only now

    t = threading.Thread(target=listener_flood, daemon=True)
    t.start()
    try:
        res = run_procs(2, code=_FLOODED_JOB, env=env_of, timeout=90)
    finally:
        stop.set()
        t.join(5)
        for f in floods:
            f.close()
    assert all("FLOODED JOB OK" in out for out in res.outputs), res.report()
    assert len(floods) == 2 and floods[1].opened > 20, [f.opened for f in floods]
