"""Launches the torch SPMD files (ops, optimizer, functions) together, once per world size,
under real `mpirun` with a hard timeout (tests/_spmd.py prints every rank's log on failure).

One launch per world size keeps torch's import and MPI start-up from being paid per file.
"""
from __future__ import annotations

import re

import pytest

from tests._spmd import mpi_available, run_spmd, skip_or_fail

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


@pytest.mark.spmd_driver
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("mode", ["mpi", "tcp"])
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_torch_horovod_parity(np_: int, mode: str) -> None:
    """Scale-factor arithmetic, broadcast gradients in process sets, alltoall's received splits
    and horovod.common.exceptions, bit for bit as Horovod, at 2 and 3 ranks in both modes."""
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    run_spmd("tests/parallel/test_torch_horovod_parity.py", np_, TIMEOUT, mode=mode)


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
def test_torch_optimizer_per_gradient_mode() -> None:
    """DistributedOptimizer without buckets (HOROVOD_BUCKET_CAP_MB=0: one allreduce per
    gradient, as Horovod), at 2 ranks."""
    run_spmd("tests/parallel/test_torch_optimizer.py", 2, TIMEOUT,
             env={"HOROVOD_BUCKET_CAP_MB": "0"})


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,np_", [("mpi", 2), ("tcp", 3)], ids=["mpi-np2", "tcp-np3"])
def test_torch_gradient_set(mode: str, np_: int) -> None:
    """Per-gradient mode's gradient set: join, a different model on one rank, re-init, a reset
    mid-step, a stalled rank (tests/parallel/test_torch_gradset.py)."""
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    run_spmd("tests/parallel/test_torch_gradset.py", np_, 120, mode=mode,
             env={"HOROVOD_BUCKET_CAP_MB": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})


@pytest.mark.spmd_driver
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,np_", [("mpi", 2), ("tcp", 3)], ids=["mpi-np2", "tcp-np3"])
def test_torch_gradient_set_stall_shutdown(mode: str, np_: int) -> None:
    """A rank that stops stepping in per-gradient mode: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
    ends the job on every rank with an error instead of a hang."""
    if mode == "mpi":
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    run_spmd("tests/parallel/test_torch_gradset.py", np_, 90, mode=mode,
             env={"HOROVOD_BUCKET_CAP_MB": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                  "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"},
             args=["-k", "test_stall_shutdown_ends_the_step"])


@pytest.mark.spmd_driver
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_examples_run_unchanged_with_horovod_torch() -> None:
    """Both PyTorch examples at 2 ranks, with `import horovod.torch as hvd` as written."""
    res = run_spmd("examples/pytorch/pytorch_synthetic_benchmark.py", 2, 120,
                   env={"OMP_NUM_THREADS": "1"},
                   args=["--no-cuda", "--model", "resnet_tiny", "--batch-size", "4",
                         "--image-size", "32", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                         "--num-iters", "2"])
    log = res.ranks[0].log
    for line in ("Model: resnet_tiny", "Batch size: 4", "Number of CPUs: 2", "Running warmup...",
                 "Running benchmark...", "Iter #1:", "Img/sec per CPU:",
                 "Total img/sec on 2 CPU(s):"):
        assert line in log, f"missing {line!r} in rank 0's output:\n{log}"
    assert "Model:" not in res.ranks[1].log, "only rank 0 prints"
    res = run_spmd("examples/pytorch/pytorch_mnist.py", 2, 120,
                   args=["--epochs", "1", "--log-interval", "100"])
    assert "Data: synthetic MNIST-shaped data" in res.ranks[0].log, res.ranks[0].log
    assert "Test set (synthetic MNIST-shaped data): Average loss:" in res.ranks[0].log
    accs = [float(x) for x in re.findall(r"Accuracy: ([0-9.]+)%", res.ranks[0].log)]
    assert accs and accs[-1] > 50.0, f"training did not learn:\n{res.ranks[0].log}"
