"""HOROVOD_AUTOTUNE=1 in real 2-rank jobs, MPI and tcp: results stay correct while the fusion
threshold and cycle time change, and all ranks switch at the same rounds (`_autotune.py`); with a
torch DistributedOptimizer, training runs through bucket-size and response-cache switches with
the same buckets on every rank in every step and correct gradients (`_autotune_torch.py`)."""
from __future__ import annotations

import os

import pytest

from tests._spmd import run_spmd

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autotune.py")
TORCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autotune_torch.py")


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


@pytest.mark.spmd_driver
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [pytest.param("mpi", marks=pytest.mark.mpi), "tcp"])
def test_autotune_with_distributed_optimizer(mode, tmp_path):
    pytest.importorskip("torch")
    log = str(tmp_path / "autotune.csv")
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log,
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1"}
    run_spmd(TORCH_SCRIPT, np=2, timeout=240, mode=mode, env=env, args=[log])
    assert os.path.exists(log)
