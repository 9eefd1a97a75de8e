"""The NCCL engine's logic (packing tables, padding, uneven allgather/reducescatter, alltoall,
scaling, error paths, mixed host/device work) on a fake GPU, so that CI without CUDA runs it.

`_fake_cases.py` runs in a fresh interpreter because it installs a fake `cupy` into
`sys.modules` before `collective.engines.nccl` is imported.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))


@pytest.mark.timeout(240)
def test_nccl_engine_on_fake_gpu() -> None:
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(_HERE, "_fake_cases.py")],
                          cwd=_REPO, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=_REPO))
    assert proc.returncode == 0, (f"fake-GPU engine cases failed (rc={proc.returncode}):\n"
                                  + proc.stdout[-20000:] + "\n" + proc.stderr[-5000:])
    assert " 0 failed" in proc.stdout
