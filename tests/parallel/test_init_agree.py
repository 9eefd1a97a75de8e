"""init() under real ranks, MPI and tcp (`_init_agree.py`): ranks that pass different static
process sets all raise the same ValueError (no hang, no later IndexError), and rank 0's
HOROVOD_FUSION_THRESHOLD / HOROVOD_CACHE_CAPACITY apply on every rank (correct results, a
warning on the others)."""
from __future__ import annotations

import os

import pytest

from tests._spmd import mpi_available, run_spmd, skip_or_fail

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_init_agree.py")


@pytest.mark.spmd_driver
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["sets-lists", "sets-count", "fusion", "cache"])
@pytest.mark.parametrize("mode,np_", [("mpi", 2), ("tcp", 3)], ids=["mpi-np2", "tcp-np3"])
def test_init_agreement(mode: str, np_: int, case: str) -> None:
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    env = {"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_CACHE_CAPACITY": ""}
    run_spmd(SCRIPT, np_, 60, mode=mode, env=env, args=[case])
