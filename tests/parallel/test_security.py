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

from tests.parallel.test_tcp_runtime import _base_env, _report, _spawn

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
import collective.coordinator as co
from collective.engines import tcp

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
        return dict(_base_env(), RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port - 1), HOROVOD_GLOO_TIMEOUT_SECONDS="10",
                    PWNED=str(pwned), ATTACK_AT=where)

    script = (f"import os\nV = {_VICTIM!r}\nA = {_ATTACKER!r}\n"
              "exec(V if os.environ['RANK'] == '0' else A)\n")
    res = _spawn(script, 2, env_of, timeout=45)
    assert not pwned.exists(), "the attacker's pickle ran inside rank 0\n" + _report(res)
    rc, out = res[0]
    assert rc == 0 and "VICTIM: refused" in out, _report(res)
    assert "malformed" in out and "rank 1" in out, _report(res)
    # rank 0 said, once, that the job is not authenticated
    assert out.count("without a job secret") == 1, _report(res)
