"""Options that ringvod accepts without effect warn at init(), and HOROVOD_MPI_THREADS_DISABLE
works: under real MPI ranks (`_switches.py`). HOROVOD_THREAD_AFFINITY on a core that is not
there, and HOROVOD_LOG_LEVEL while the world forms: under hvdrun --tcp (`_thread_affinity.py`,
`_log_level.py`)."""
from __future__ import annotations

import os
import re

import pytest

from tests._spmd import run_spmd

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_switches.py")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["disabled", "default", "cpu_gloo"])
def test_mpi_threads_disable_and_no_effect_warning(case):
    env = {"HOROVOD_MPI_THREADS_DISABLE": "", "HOROVOD_TORUS_ALLREDUCE": "",
           "HOROVOD_CPU_OPERATIONS": "", "HOROVOD_CONTROLLER": ""}
    if case == "disabled":
        env.update(HOROVOD_MPI_THREADS_DISABLE="1", HOROVOD_TORUS_ALLREDUCE="1")
    if case == "cpu_gloo":
        env.update(HOROVOD_CPU_OPERATIONS="gloo")
    run_spmd(SCRIPT, np=2, timeout=90, env=env, args=[case])


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(120)
def test_thread_affinity_on_a_missing_core_logs_and_runs_unpinned():
    script = os.path.join(os.path.dirname(SCRIPT), "_thread_affinity.py")
    res = run_spmd(script, np=2, timeout=60, mode="tcp",
                   env={"HOROVOD_THREAD_AFFINITY": "65535,65534"})
    text = res.launcher_output + "".join(r.log for r in res.ranks)
    assert "HOROVOD_THREAD_AFFINITY=65535,65534: cannot pin the coordinator thread" in text, (
        res.report())


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(120)
def test_log_level_applies_while_the_world_forms():
    script = os.path.join(os.path.dirname(SCRIPT), "_log_level.py")
    res = run_spmd(script, np=2, timeout=60, mode="tcp",
                   env={"HOROVOD_LOG_LEVEL": "debug", "HOROVOD_LOG_HIDE_TIME": "1"})
    text = res.launcher_output + "".join(r.log for r in res.ranks)
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\]\[D plane\.py:\d+\] tcp mode: rank {rank} of 2 ready",
                         text), res.report()
