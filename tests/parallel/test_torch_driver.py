"""Launches the torch SPMD files (ops, optimizer, functions) together, once per world size,
under real `mpirun` with a hard timeout (tests/_spmd.py prints every rank's log on failure).

One launch per world size keeps torch's import and MPI start-up from being paid per file.
"""
from __future__ import annotations

import pytest

from tests._spmd import run_spmd

FILES = ["tests/parallel/test_torch_ops.py", "tests/parallel/test_torch_optimizer.py",
         "tests/parallel/test_torch_functions.py"]
TIMEOUT = 240.0

pytest.importorskip("torch")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("np_", [1, 2, 4], ids=["np1", "np2", "np4"])
def test_torch_spmd(np_: int, request: pytest.FixtureRequest) -> None:
    selected = request.config.getoption("--np", default=None)
    if selected and np_ not in selected:
        pytest.skip(f"np={np_} not selected by --np")
    run_spmd(FILES, np_, TIMEOUT)
