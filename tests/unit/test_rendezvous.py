"""The rendezvous key-value store: round trips, waiting gets, authentication, forged frames."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from collective.errors import CollectiveTimeoutError, HorovodInternalError
from collective.auth import RECV_STEP, Channel, handshake_client, recv_exact
from collective.rendezvous import KV_MAGIC, KVClient, KVServer

SECRET = os.urandom(32)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = KVServer("127.0.0.1", 0, SECRET)
    s.start()
    yield s
    s.stop()


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture):
    """The `horovod` logger does not propagate to the root logger: attach caplog directly."""
    logger = logging.getLogger("horovod")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)


def _wait_for(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_round_trip(server: KVServer) -> None:
    host, port = server.address
    assert host == "127.0.0.1"
    with KVClient(host, port, SECRET, timeout=5) as c:
        c.put("global", "0", b"10.0.0.1:4000")
        c.put("global", "empty", b"")
        big = os.urandom(5 << 20)
        c.put("local_h", "big", big)
        assert c.get("global", "0") == b"10.0.0.1:4000"
        assert c.get("global", "empty") == b""
        assert c.get("local_h", "big") == big
        assert server.get("global", "0") == b"10.0.0.1:4000"
        c.delete("global", "0")
        c.delete("global", "never-existed")
        assert server.get("global", "0") is None
        server.put("s", "k", b"from the server")
        assert c.get("s", "k") == b"from the server"


@pytest.mark.parametrize("delay", [0.3, 2.5])  # 2.5 s: past two checks that the client is there
def test_get_waits_for_a_later_put(server: KVServer, delay: float) -> None:
    host, port = server.address
    with KVClient(host, port, SECRET, timeout=5) as a, KVClient(host, port, SECRET) as b:
        later = threading.Timer(delay, b.put, ("global", "late", b"v"))
        later.start()
        t0 = time.monotonic()
        assert a.get("global", "late", timeout=30) == b"v"
        assert delay - 0.1 < time.monotonic() - t0 < delay + 3
        later.join(5)  # its put may still await the reply: b must stay open until then


def test_get_timeout_names_key_address_and_fix(server: KVServer) -> None:
    host, port = server.address
    with KVClient(host, port, SECRET, timeout=5) as c:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            c.get("global", "missing", timeout=0.3)
        assert time.monotonic() - t0 < 3
    msg = str(info.value)
    assert "'global'/'missing'" in msg and f"127.0.0.1:{port}" in msg
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" in msg


@pytest.mark.parametrize("secret", [b"", b"wrong secret"])
def test_client_without_the_secret_is_refused_and_logged(server: KVServer, log, secret) -> None:
    host, port = server.address
    with KVClient(host, port, secret, timeout=5) as c:
        with pytest.raises(HorovodInternalError, match="refused authentication"):
            c.put("global", "x", b"evil")
    assert server.get("global", "x") is None
    assert _wait_for(lambda: "refused a connection from 127.0.0.1:" in log.text), log.text


def test_server_without_the_secret_is_not_trusted() -> None:
    """Authentication is mutual: a server that cannot prove the secret is refused."""
    with KVServer("127.0.0.1", 0, b"impostor") as impostor:
        host, port = impostor.address
        with KVClient(host, port, SECRET, timeout=5) as c:
            with pytest.raises(HorovodInternalError):
                c.put("global", "x", b"secret stuff")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _frame(key: bytes, seq: int, body: bytes, direction: bytes = b"c") -> bytes:
    mac = _mac(key, direction, struct.pack("!Q", seq), body)
    return struct.pack("!I", len(body) + len(mac)) + body + mac


def _put_body(scope: str, key: str, value: bytes) -> bytes:
    return struct.pack("!cHH", b"P", len(scope), len(key)) + scope.encode() + key.encode() + value


def test_forged_frame_after_authentication_is_rejected(server: KVServer, log) -> None:
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as s:
        key = handshake_client(s, SECRET, KV_MAGIC, b"kv", 5.0, "server")
        s.sendall(_frame(key, 0, _put_body("global", "ok", b"1")))
        n = struct.unpack("!I", recv_exact(s, 4))[0]
        assert recv_exact(s, n)[:1] == b"\x00"  # a correct frame is served
        forged = bytearray(_frame(key, 1, _put_body("global", "ok", b"2")))
        forged[-1] ^= 1  # one flipped bit of the MAC
        s.sendall(bytes(forged))
        with pytest.raises((ConnectionError, OSError)):
            recv_exact(s, 4)
    assert server.get("global", "ok") == b"1"
    assert _wait_for(lambda: "failed authentication" in log.text), log.text


def test_replayed_frame_is_rejected(server: KVServer, log) -> None:
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as s:
        key = handshake_client(s, SECRET, KV_MAGIC, b"kv", 5.0, "server")
        frame = _frame(key, 0, _put_body("global", "r", b"1"))
        s.sendall(frame)
        n = struct.unpack("!I", recv_exact(s, 4))[0]
        recv_exact(s, n)
        server.delete("global", "r")
        s.sendall(frame)  # same bytes again: its sequence number is stale
        with pytest.raises((ConnectionError, OSError)):
            recv_exact(s, 4)
    assert server.get("global", "r") is None
    assert _wait_for(lambda: "failed authentication" in log.text)


def test_a_frame_length_alone_does_not_allocate_the_frame() -> None:
    # The length comes before the MAC can be checked: a peer that claims a 64 MiB frame and
    # sends 1 kB makes the receiver hold about what arrived, not 64 MiB.
    a, b = socket.socketpair()
    with a, b:
        chan = Channel(b, os.urandom(32), b"s", b"c", 128 << 20)
        a.sendall(struct.pack("!I", 64 << 20) + os.urandom(1000))
        a.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(ConnectionError, match="after 1000 of"):
                chan.recv()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 4 * RECV_STEP, peak


@pytest.mark.parametrize("size", [0, RECV_STEP - 32, RECV_STEP - 31, 3 * RECV_STEP + 7])
def test_frames_around_the_read_step_round_trip_and_are_checked(size: int) -> None:
    a, b = socket.socketpair()
    with a, b:
        key = os.urandom(32)
        tx, rx = Channel(a, key, b"c", b"s", 1 << 20), Channel(b, key, b"s", b"c", 1 << 20)
        body = os.urandom(size)
        t = threading.Thread(target=tx.send, args=(body,))
        t.start()
        assert rx.recv() == body
        t.join()
        forged = bytearray(_frame(key, 1, body))
        forged[-1] ^= 1
        t = threading.Thread(target=a.sendall, args=(bytes(forged),))
        t.start()
        assert rx.recv() is None
        t.join()


def test_oversized_hello_from_unauthenticated_peer_is_dropped(server: KVServer, log) -> None:
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as s:
        recv_exact(s, len(KV_MAGIC) + 32)
        s.sendall(os.urandom(32) + struct.pack("!H", 60000))  # claims a 60 kB hello
        with pytest.raises((ConnectionError, OSError)):
            recv_exact(s, 1)
    assert _wait_for(lambda: "refused a connection" in log.text)


def test_silent_peer_is_dropped_after_the_handshake_timeout(log) -> None:
    srv = KVServer("127.0.0.1", 0, SECRET)
    srv.handshake_timeout = 0.3
    host, port = srv.start()
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            t0 = time.monotonic()
            recv_exact(s, len(KV_MAGIC) + 32)
            with pytest.raises((ConnectionError, OSError)):
                recv_exact(s, 1)  # we say nothing; the server hangs up
            assert time.monotonic() - t0 < 3
    finally:
        srv.stop()


class _Boom:
    def __reduce__(self):
        return (open, ("/tmp/ringvod-should-not-exist", "w"))


def test_values_are_never_unpickled(server: KVServer) -> None:
    path = "/tmp/ringvod-should-not-exist"
    if os.path.exists(path):
        os.unlink(path)
    payload = pickle.dumps(_Boom())
    host, port = server.address
    with KVClient(host, port, SECRET, timeout=5) as c:
        c.put("global", "p", payload)
        assert c.get("global", "p") == payload
    assert not os.path.exists(path)
    import collective.auth
    import collective.rendezvous
    for mod in (collective.rendezvous, collective.auth):
        src = open(mod.__file__).read()
        assert "import pickle" not in src and "loads(" not in src, mod.__name__


def test_client_waits_for_a_server_that_starts_later() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = KVServer("127.0.0.1", port, SECRET)
    threading.Timer(0.4, srv.start).start()
    try:
        with KVClient("127.0.0.1", port, SECRET, timeout=10) as c:
            c.put("global", "k", b"v")
            assert c.get("global", "k") == b"v"
    finally:
        _wait_for(lambda: srv.port == port)
        srv.stop()


def test_client_reconnects_after_server_restart() -> None:
    srv = KVServer("127.0.0.1", 0, SECRET)
    _, port = srv.start()
    c = KVClient("127.0.0.1", port, SECRET, timeout=10)
    try:
        c.put("g", "a", b"1")
        srv.stop()
        srv2 = KVServer("127.0.0.1", port, SECRET)
        srv2.start()
        try:
            srv2.put("g", "b", b"2")
            assert c.get("g", "b") == b"2"
        finally:
            srv2.stop()
    finally:
        c.close()


def test_unreachable_server_times_out_with_a_fix() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with KVClient("127.0.0.1", port, SECRET, timeout=0.5) as c:
        with pytest.raises(CollectiveTimeoutError, match="could not reach"):
            c.put("g", "a", b"1")


def test_stop_joins_every_thread() -> None:
    srv = KVServer("127.0.0.1", 0, SECRET)
    host, port = srv.start()
    clients = [KVClient(host, port, SECRET, timeout=5) for _ in range(3)]
    for i, c in enumerate(clients):
        c.put("g", str(i), b"x")
    waiter_err: list[BaseException] = []

    def wait_forever() -> None:
        try:
            clients[0].get("g", "never", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            waiter_err.append(exc)

    t = threading.Thread(target=wait_forever, name="test-waiter")
    t.start()
    time.sleep(0.2)
    raw = socket.create_connection((host, port))  # an unauthenticated connection, too
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5
    assert not [th.name for th in threading.enumerate() if th.name.startswith("hvd-kv-")]
    raw.close()
    for c in clients:
        c.close()  # also ends the waiting get (it was reconnecting to a stopped server)
    t.join(5)
    assert not t.is_alive()
    assert isinstance(waiter_err[0], HorovodInternalError), waiter_err


def test_closed_clients_release_their_waiting_gets(server: KVServer) -> None:
    """A get waiting on the server ends when its client hangs up: the connection's thread and
    socket go at once, not when the get's wait runs out."""
    host, port = server.address
    clients = [KVClient(host, port, SECRET, timeout=5) for _ in range(20)]
    errors: list[BaseException] = []

    def follow(c: KVClient) -> None:
        try:
            c.get("elastic", "update.0", timeout=3600)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=follow, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    assert _wait_for(lambda: len(server._conns) == 20), len(server._conns)
    time.sleep(0.2)  # the gets reach the server and wait there
    for c in clients:
        c.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 20 and all(isinstance(e, HorovodInternalError) for e in errors)
    assert _wait_for(lambda: not server._conns, 5.0), (
        f"server connection threads still held: {len(server._conns)}")
    with KVClient(host, port, SECRET, timeout=5) as c:  # the server still serves
        c.put("elastic", "update.0", b"1")
        assert c.get("elastic", "update.0") == b"1"
