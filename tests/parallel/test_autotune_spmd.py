"""HOROVOD_AUTOTUNE=1 in real 2-rank jobs, MPI and tcp (`_autotune.py`): results stay correct
while the fusion threshold changes, and all ranks switch at the same rounds."""
from __future__ import annotations

import os

import pytest

from tests._spmd import run_spmd

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autotune.py")


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", [pytest.param("mpi", marks=pytest.mark.mpi), "tcp"])
def test_autotune_two_ranks(mode, tmp_path):
    log = str(tmp_path / "autotune.csv")
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log,
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "12"}
    run_spmd(SCRIPT, np=2, timeout=120, mode=mode, env=env, args=[log])
    assert os.path.exists(log)
