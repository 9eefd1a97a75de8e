"""Launches the JAX SPMD checks (tests/parallel/spmd_jax.py, one launch per mode so JAX is
imported once per rank) at 2 ranks under mpirun and under `hvdrun --gloo` (tcp engine), and the
JAX example under `hvdrun`. Ranks run JAX on the CPU (`JAX_PLATFORMS=cpu`): the adapter moves
host arrays only.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from tests._spmd import run_spmd, skip_or_fail

FILE = "tests/parallel/spmd_jax.py"
ENV = {"JAX_PLATFORMS": "cpu"}
TIMEOUT = 300.0


def _ran_checks(res) -> None:
    """Every rank ran checks (not a script run that defines tests but runs none)."""
    assert all(r.passed > 0 for r in res.ranks), [(r.rank, r.status, r.passed)
                                                  for r in res.ranks]


@pytest.fixture(autouse=True)
def _jax_installed() -> None:
    if importlib.util.find_spec("jax") is None:
        skip_or_fail('JAX is not installed (pip install ".[jax]")', "jax")


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_jax_spmd_mpi() -> None:
    _ran_checks(run_spmd(FILE, 2, TIMEOUT, env=ENV))


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_jax_spmd_tcp_mode() -> None:
    """The same checks with ranks started by `hvdrun --gloo` (tcp engine)."""
    _ran_checks(run_spmd(FILE, 2, TIMEOUT, mode="tcp", env=ENV))


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_jax_example_runs_as_written() -> None:
    """The JAX example at 2 ranks under `hvdrun`, with `import horovod.jax as hvd`."""
    if importlib.util.find_spec("optax") is None:
        skip_or_fail('optax is not installed (pip install ".[jax]")', "jax")
    res = run_spmd("examples/jax/jax_mnist_mlp.py", 2, 150, mode="tcp", env=ENV,
                   args=["--steps", "60"])
    log = res.ranks[0].log
    accs = [float(x) for x in re.findall(r"Final accuracy .*: ([0-9.]+)%", log)]
    assert accs and accs[-1] > 50.0, f"JAX example did not learn:\n{log}"
    assert "Final accuracy" not in res.ranks[1].log, "only rank 0 prints"
