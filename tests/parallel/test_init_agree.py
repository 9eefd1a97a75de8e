"""init() under real ranks, MPI and tcp (`_init_agree.py`): ranks that pass different process
sets (static, or "dynamic" on some only) all raise the same ValueError (no hang, no later
IndexError), a set given as an mpi4py communicator on some ranks and as its ranks on others is
one set, the communicators of a split (each rank its own) are a set each, and rank 0's
HOROVOD_FUSION_THRESHOLD / HOROVOD_CACHE_CAPACITY apply on every rank (correct results, a
warning on the others)."""
from __future__ import annotations

import os

import pytest

from tests._spmd import mpi_available, run_spmd, skip_or_fail

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_init_agree.py")


@pytest.mark.spmd_driver
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["sets-lists", "sets-count", "sets-dynamic", "fusion",
                                  "cache"])
@pytest.mark.parametrize("mode,np_", [("mpi", 2), ("tcp", 3)], ids=["mpi-np2", "tcp-np3"])
def test_init_agreement(mode: str, np_: int, case: str) -> None:
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    env = {"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_CACHE_CAPACITY": ""}
    run_spmd(SCRIPT, np_, 60, mode=mode, env=env, args=[case])


@pytest.mark.spmd_driver
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["comm", "comm-dynamic", "comm-other", "comm-split"])
def test_communicator_process_set(case: str) -> None:
    reason = mpi_available()
    if reason:
        skip_or_fail(reason, "mpi")
    run_spmd(SCRIPT, 3, 60, mode="mpi", args=[case])
