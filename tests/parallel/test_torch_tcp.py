"""The PyTorch adapter's SPMD suites in tcp mode (ranks started by `hvdrun --gloo`)."""
from __future__ import annotations

import pytest

from tests._spmd import run_spmd

FILES = ["tests/parallel/test_torch_ops.py", "tests/parallel/test_torch_optimizer.py",
         "tests/parallel/test_torch_functions.py"]


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.timeout(300)
def test_torch_suites_in_tcp_mode() -> None:
    run_spmd(FILES, 2, timeout=240, mode="tcp")
