"""Launches the TensorFlow/Keras SPMD checks (tests/parallel/spmd_tensorflow.py, one launch per
world size and mode so TensorFlow is imported once per rank) and the TF examples.

Each rank uses one TensorFlow thread per pool (TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS):
with several ranks on a 2-core machine, TensorFlow's default pools (one thread per core, which
spin while waiting) slow every rank down.
"""
from __future__ import annotations

import re

import pytest

from tests._spmd import run_spmd, skip_or_fail

FILE = "tests/parallel/spmd_tensorflow.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
# The subset run at 4 ranks: the collectives on every dtype, their gradients, and both
# training-equality checks.
SUBSET = ["-k", "every_dtype or gradients or equals_full_batch or process_set"]
TIMEOUT = 420.0


def _ran_checks(res) -> None:
    """Every rank ran checks (the harness once ran spmd_tensorflow.py as a script, which
    defines tests but runs none, and reported that as passed)."""
    assert all(r.passed > 0 for r in res.ranks), [(r.rank, r.status, r.passed)
                                                  for r in res.ranks]


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("np_", [1, 2, 4], ids=["np1", "np2", "np4"])
def test_tensorflow_spmd(np_: int, request: pytest.FixtureRequest) -> None:
    selected = request.config.getoption("--np", default=None)
    if selected and np_ not in selected:
        pytest.skip(f"np={np_} not selected by --np")
    _ran_checks(run_spmd(FILE, np_, TIMEOUT, env=ENV, args=SUBSET if np_ == 4 else ()))


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_tensorflow_spmd_tcp_mode() -> None:
    """The same checks with ranks started by `hvdrun --gloo` (tcp engine)."""
    _ran_checks(run_spmd(FILE, 2, TIMEOUT, mode="tcp", env=ENV))


@pytest.mark.spmd_driver
@pytest.mark.tcp
@pytest.mark.slow
@pytest.mark.timeout(330)
def test_tensorflow_examples_run_as_written() -> None:
    """Both TF examples at 2 ranks under `hvdrun`, with `import horovod.tensorflow as hvd`."""
    res = run_spmd("examples/tensorflow/tensorflow2_keras_synthetic.py", 2, 150, mode="tcp",
                   env=ENV, args=["--epochs", "2", "--steps-per-epoch", "20"])
    log = res.ranks[0].log
    accs = [float(x) for x in re.findall(r"Final accuracy .*: ([0-9.]+)%", log)]
    assert accs and accs[-1] > 50.0, f"Keras example did not learn:\n{log}"
    assert "checkpoint-2.keras" in log, "rank 0 saves a checkpoint per epoch"
    assert "Final accuracy" not in res.ranks[1].log, "only rank 0 prints"
    res = run_spmd("examples/tensorflow/tensorflow2_mnist.py", 2, 150, mode="tcp", env=ENV,
                   args=["--steps", "60"])
    log = res.ranks[0].log
    accs = [float(x) for x in re.findall(r"Final accuracy .*: ([0-9.]+)%", log)]
    assert accs and accs[-1] > 50.0, f"custom-loop example did not learn:\n{log}"


@pytest.fixture(autouse=True)
def _tensorflow_installed() -> None:
    import importlib.util
    if importlib.util.find_spec("tensorflow") is None:
        skip_or_fail('TensorFlow is not installed (pip install ".[tensorflow]")', "tensorflow")
