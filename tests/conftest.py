"""Test-suite policy: markers, the `--np` option, a per-test watchdog, skip-or-fail, SPMD split.

* Markers: `mpi`, `gpu`, `nccl`, `tcp` (needs that backend), `slow`, `spmd` (a rank-side test:
  runs only inside ranks started by `tests/_spmd.py` or an MPI launcher), `spmd_driver` (a
  test that launches ranks: runs only outside them).
* Skip-or-fail: a test marked `mpi`/`gpu`/`nccl` whose backend is missing is skipped, unless
  `RINGVOD_TEST_REQUIRE` (comma list; CI sets `mpi`) names it, which turns the skip into a
  failure.
* Watchdog: every test arms `faulthandler.dump_traceback_later` a little before its
  pytest-timeout, so a hang prints every thread's stack even if the timeout method fails.
* Hypothesis profile `ringvod` (loaded by default): derandomized, no example database, no
  shrinking and no timing health checks, so every rank of an SPMD run draws the same examples
  in the same order. `RINGVOD_HYPOTHESIS_EXAMPLES` overrides the example count.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import sys

import pytest

from tests._spmd import in_spmd_rank, mpi_available, skip_or_fail

_DEFAULT_TIMEOUT = float(os.environ.get("RINGVOD_TEST_TIMEOUT", "300"))

try:
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile(
        "ringvod",
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        max_examples=int(os.environ.get("RINGVOD_HYPOTHESIS_EXAMPLES", "25")),
        phases=(Phase.explicit, Phase.generate),  # shrinking could diverge across ranks
        suppress_health_check=list(HealthCheck),
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ringvod"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--np", action="store", default=None,
                     type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                     help="world sizes for SPMD driver tests, e.g. --np 2 or --np 1,4 "
                          "(default: each driver's own list, usually 1,2,4)")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "mpi: needs mpi4py and mpirun (skipped if missing unless RINGVOD_TEST_REQUIRE has mpi)",
        "gpu: needs CUDA GPUs (skipped if missing unless RINGVOD_TEST_REQUIRE has gpu)",
        "nccl: needs NCCL through CuPy",
        "tcp: needs the tcp engine",
        "slow: takes more than a few seconds",
        "spmd: rank-side SPMD test; runs only inside ranks (tests/_spmd.py or mpirun)",
        "spmd_driver: launches SPMD ranks; runs only outside ranks",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    inside = in_spmd_rank()
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("spmd_driver") is not None:
            (drop if inside else keep).append(item)
        elif item.get_closest_marker("spmd") is not None:
            (keep if inside else drop).append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _gpu_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install cupy-cuda12x nvidia-nccl-cu12)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any failure means no usable GPU
        return f"no usable CUDA device ({exc})"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("mpi") is not None and item.get_closest_marker("spmd") is None:
        reason = mpi_available()
        if reason:
            skip_or_fail(reason, "mpi")
    for name in ("gpu", "nccl"):
        if item.get_closest_marker(name) is not None:
            reason = _gpu_reason()
            if reason:
                skip_or_fail(reason, name)


def _timeout_of(item: pytest.Item) -> float:
    m = item.get_closest_marker("timeout")
    if m is not None and m.args:
        return float(m.args[0])
    if m is not None and "timeout" in m.kwargs:
        return float(m.kwargs["timeout"])
    try:  # pytest-timeout's ini option (pyproject: timeout = 300)
        ini = item.config.getini("timeout")
        return float(ini) if ini else _DEFAULT_TIMEOUT
    except (TypeError, ValueError):
        return _DEFAULT_TIMEOUT


@pytest.fixture(autouse=True)
def _watchdog(request: pytest.FixtureRequest):
    """Dumps every thread's stack shortly before the test's timeout (hang diagnosis)."""
    limit = _timeout_of(request.node)
    faulthandler.dump_traceback_later(max(limit - 2.0, 1.0), exit=False, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
