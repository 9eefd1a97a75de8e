"""`horovod.run` (launcher/api.py) and end-to-end jobs that use the ringvod runtime.

Each `horovod.run` call happens in a fresh interpreter (as a user's script would), with a hard
timeout; the child's whole output is shown on failure.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

try:  # tests/integration as a package, or as a plain directory on sys.path
    from .test_launcher import (HAVE_MPI, MODES, REPO, _env, _need, explain, run_hvdrun)
except ImportError:
    from test_launcher import (HAVE_MPI, MODES, REPO, _env, _need, explain, run_hvdrun)


def run_py(code: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=_env(), cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_run_returns_results_by_rank(mode):
    _need(mode)
    flag = "use_gloo=True" if mode == "tcp" else "use_mpi=True"
    r = run_py(f"""
        import os
        import horovod
        from horovod.runner import run
        assert horovod.run is run
        def f(a, b=0):
            rank = int(os.environ.get("HOROVOD_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
            return {{"rank": rank, "sum": a + b}}
        print("RESULT", run(f, args=(1,), kwargs={{"b": 2}}, num_proc=3, {flag}))
        print("LAMBDA", run(lambda: "ok", num_proc=2, {flag}))
        """)
    assert r.returncode == 0, explain(r)
    assert "RESULT [{'rank': 0, 'sum': 3}, {'rank': 1, 'sum': 3}, {'rank': 2, 'sum': 3}]" \
        in r.stdout, explain(r)
    assert "LAMBDA ['ok', 'ok']" in r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_run_raises_when_a_rank_fails(mode):
    _need(mode)
    flag = "use_gloo=True" if mode == "tcp" else "use_mpi=True"
    r = run_py(f"""
        import os, time
        from launcher.api import run
        def f():
            rank = int(os.environ.get("HOROVOD_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
            if rank == 1:
                raise ValueError("boom on rank one")
            time.sleep(60)
        t = time.monotonic()
        try:
            run(f, num_proc=2, {flag})
        except RuntimeError as e:
            print("RAISED", type(e).__name__, time.monotonic() - t)
            print(e)
        """)
    assert r.returncode == 0, explain(r)
    m = re.search(r"RAISED RuntimeError ([\d.]+)", r.stdout)
    assert m and float(m.group(1)) < 20, explain(r)
    assert "ValueError: boom on rank one" in r.stdout + r.stderr
    if mode == "tcp":
        assert "Process name: 1\nExit code: 1\n" in r.stdout
    else:  # Horovod's mpi_run text
        assert re.search(r"mpirun failed with exit code [1-9]", r.stdout), explain(r)


@pytest.mark.timeout(60)
def test_run_argument_errors():
    r = run_py("""
        from launcher.api import run
        for kw in ({"num_proc": 3, "hosts": "a:1"}, {"num_proc": 1, "min_num_proc": 1},
                   {"num_proc": 1, "use_gloo": True, "use_mpi": True},
                   {"num_proc": 1, "hosts": "a:1", "hostfile": "f"}):
            try:
                run(print, **kw)
            except (ValueError, NotImplementedError) as e:
                print("ERR", type(e).__name__, e)
        """)
    assert r.returncode == 0, explain(r)
    assert r.stdout.count("ERR ") == 4, explain(r)
    assert "available slots (1)" in r.stdout and "elastic" in r.stdout
    # Horovod's texts (horovod/runner/__init__.py).
    assert "ERR ValueError Argument use_gloo and use_mpi only allow one set True." in r.stdout
    assert "ERR ValueError Argument hosts and hostfile only allow one provided." in r.stdout


@pytest.mark.timeout(90)
def test_run_reset_limit_warns_that_it_has_no_effect():
    r = run_py("""
        import warnings
        from launcher.api import run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("RESULT", run(lambda: 7, num_proc=1, use_gloo=True, reset_limit=2))
        print("WARNED", [str(w.message) for w in caught if "reset_limit" in str(w.message)])
        """)
    assert r.returncode == 0, explain(r)
    assert "RESULT [7]" in r.stdout, explain(r)
    assert "has no effect unless the run is elastic" in r.stdout, explain(r)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_hello_allreduce(mode, np_):
    """hvdrun + the runtime: every rank gets the sum of all ranks."""
    _need(mode)
    if mode == "tcp" and not (REPO / "collective" / "engines" / "tcp").is_dir():
        pytest.skip("tcp engine not present in this tree")
    r = run_hvdrun("-np", str(np_), f"--{mode}", sys.executable, "examples/hello_allreduce.py",
                   timeout=120)
    assert r.returncode == 0, explain(r)
    total = np_ * (np_ - 1) // 2
    for rank in range(np_):
        assert re.search(rf"^\[(1,)?{rank}\]<stdout>:\s?rank {rank}/{np_} .*mode {mode}\): "
                         rf"allreduce sum = {total}$", r.stdout, re.M), explain(r)


@pytest.mark.timeout(120)
def test_default_mode():
    r = run_hvdrun("-np", "2", "--verbose", sys.executable, "-c", "pass")
    assert r.returncode == 0, explain(r)
    assert f"mode {'mpi' if HAVE_MPI else 'tcp'}" in r.stderr
