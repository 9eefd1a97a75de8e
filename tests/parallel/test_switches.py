"""Options that ringvod accepts without effect warn at init(), and HOROVOD_MPI_THREADS_DISABLE
works: under real MPI ranks (`_switches.py`)."""
from __future__ import annotations

import os

import pytest

from tests._spmd import run_spmd

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_switches.py")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["disabled", "default"])
def test_mpi_threads_disable_and_no_effect_warning(case):
    env = ({"HOROVOD_MPI_THREADS_DISABLE": "1", "HOROVOD_TORUS_ALLREDUCE": "1"}
           if case == "disabled"
           else {"HOROVOD_MPI_THREADS_DISABLE": "", "HOROVOD_TORUS_ALLREDUCE": ""})
    run_spmd(SCRIPT, np=2, timeout=90, env=env, args=[case])
