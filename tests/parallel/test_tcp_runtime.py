"""The tcp mode end to end, through `import collective as hvd`.

* The shared SPMD suites (ops, process sets, errors, join) run under `hvdrun --tcp` at np 1,
  2 and 4 (this module registers the harness's "tcp" launcher).
* The tcp-specific rank-side tests of this file (mode, topology, init -> shutdown -> init)
  run the same way.
* Drivers start plain rank processes (`run_procs`) for what a launcher would hide:
  torchrun-style variables (rank 0 serves the store), and a rank SIGKILLed mid-allreduce (the
  survivors must raise HorovodInternalError within seconds, not hang until the timeout).
"""
from __future__ import annotations

import os
import signal
import socket

import numpy as np
import pytest

import collective as hvd
from tests._spmd import run_procs, run_spmd

SHARED = ["tests/parallel/test_ops.py", "tests/parallel/test_process_sets.py",
          "tests/parallel/test_errors.py", "tests/parallel/test_join.py"]
# Mode-specific assertions of the shared suites (they check for MPI mode).
DESELECT = "not test_topology"


# -- drivers -----------------------------------------------------------------------------------
@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [1, 2, 4], ids=lambda n: f"np{n}")
def test_shared_suites_in_tcp_mode(np_: int, request: pytest.FixtureRequest) -> None:
    selected = request.config.getoption("--np", default=None)
    if selected and np_ not in selected:
        pytest.skip(f"np={np_} not selected by --np")
    run_spmd(SHARED + [os.path.abspath(__file__)], np_, timeout=360, mode="tcp",
             args=["-k", DESELECT])


_TORCHRUN_SCRIPT = r"""
import numpy as np
import collective as hvd
for i in range(2):  # init -> shutdown -> init
    hvd.init()
    assert hvd.mode() == "tcp", hvd.mode()
    r, n = hvd.rank(), hvd.size()
    out = hvd.allreduce(np.full(1000, r + i, np.float32), op=hvd.Sum)
    assert (out == sum(range(n)) + i * n).all(), out[:4]
    g = hvd.allgather(np.full((r + 1, 2), r, np.int64))
    assert g.shape == (n * (n + 1) // 2, 2)
    hvd.shutdown()
print("torchrun-style rank", r, "ok", flush=True)
"""


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(120)
def test_torchrun_style_environment() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free: ringvod's store takes MASTER_PORT + 1

    def env_of(r: int) -> dict[str, str]:
        return dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1),
                    HOROVOD_GLOO_TIMEOUT_SECONDS="20")

    run_procs(2, code=_TORCHRUN_SCRIPT, env=env_of, timeout=90)


_KILL_SCRIPT = r"""
import os, signal, sys, threading, time, numpy as np
import collective as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
victim = n - 1
a = np.ones(4 << 20, np.float32)
hvd.allreduce(a, name="warmup")
if r == victim:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
t_kill = time.monotonic() + 0.5
try:
    for i in range(100000):
        hvd.allreduce(a, name=f"x{i % 4}")
except hvd.HorovodInternalError as exc:
    waited = time.monotonic() - t_kill
    print(f"rank {r}: {type(exc).__name__} {waited:.2f} s after the kill: {exc}", flush=True)
    assert waited < 10, waited
    try:
        hvd.allreduce(a, name="after")
    except hvd.HorovodInternalError:
        print(f"rank {r}: later ops fail too", flush=True)
        sys.exit(0)
    sys.exit("a later op succeeded after the failure")
sys.exit("no error after the peer died")
"""


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_sigkilled_rank_fails_the_survivors_fast(n: int) -> None:
    from collective.rendezvous import KVServer
    secret = os.urandom(32)
    server = KVServer("127.0.0.1", 0, secret)
    _, port = server.start()

    def env_of(r: int) -> dict[str, str]:
        return dict(HOROVOD_RANK=str(r), HOROVOD_SIZE=str(n),
                    HOROVOD_LOCAL_RANK=str(r), HOROVOD_LOCAL_SIZE=str(n),
                    HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                    HOROVOD_GLOO_RENDEZVOUS_PORT=str(port), HOROVOD_SECRET_KEY=secret.hex(),
                    HOROVOD_CONTROLLER="gloo", HOROVOD_GLOO_TIMEOUT_SECONDS="60")

    try:
        run_procs(n, code=_KILL_SCRIPT, env=env_of, timeout=60,
                  expect_rc={n - 1: -signal.SIGKILL})
    finally:
        server.stop()


# -- rank side (run by test_shared_suites_in_tcp_mode) -----------------------------------------


@pytest.mark.spmd
@pytest.mark.timeout(120)
def test_tcp_mode_topology_and_restart() -> None:
    for i in range(2):  # init -> shutdown -> init
        hvd.init()
        try:
            assert hvd.mode() == "tcp" and hvd.gloo_enabled() and not hvd.mpi_enabled()
            n, r = hvd.size(), hvd.rank()
            assert 0 <= r < n == int(os.environ["HOROVOD_SIZE"])
            assert hvd.local_size() == n and hvd.local_rank() == r
            assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
            big = np.arange(3 << 20, dtype=np.float64) + r + i
            out = hvd.allreduce(big, op=hvd.Sum, name=f"big{i}")
            expect = n * np.arange(3 << 20, dtype=np.float64) + sum(range(n)) + n * i
            assert np.array_equal(out, expect)
            hvd.barrier()
        finally:
            hvd.shutdown()
