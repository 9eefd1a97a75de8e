"""The stall check's shutdown (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) must end an MPI-mode job.

The stalled rank never reaches MPI_Finalize, and Open MPI's finalize waits for every rank: the
other ranks, after their ShutdownError, hung there, and mpirun, seeing no rank exit, never
ended the job. Rank 0 now ends the job if it is still stuck a few seconds after the stall
shutdown: MPI_Abort while it runs (it stalled itself), SIGALRM once it waits in MPI_Finalize
(the stalled rank is another). A job whose ranks all end by themselves exits as usual
(tests/parallel/test_timeline_spmd.py::test_stall_shutdown_marks_ranks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._spmd import REPO, mpi_available, skip_or_fail

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import collective as hvd
    hvd.init()
    if hvd.rank() == STALLED:
        time.sleep(300)  # a rank stuck outside collectives (a data loader, a deadlock)
    try:
        hvd.allreduce(np.ones(4), name="stalled")
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()}: {type(exc).__name__}", flush=True)
        sys.exit(1)
""")


@pytest.mark.parametrize("stalled", [1, 0])
def test_stall_shutdown_ends_the_mpi_job(tmp_path: Path, stalled: int) -> None:
    reason = mpi_available()
    if reason:
        skip_or_fail(reason, "mpi")
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT.replace("STALLED", str(stalled)))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2",
               PYTHONFAULTHANDLER="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "-np", "2", "--mpi",
                             sys.executable, str(script)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=45)[0]
    except subprocess.TimeoutExpired:
        # the ranks' Python stacks (faulthandler on SIGABRT), then everything goes
        for sig in (signal.SIGABRT, signal.SIGKILL):
            for pid in subprocess.run(["pgrep", "-f", str(script)], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), sig)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job did not end after the stall shutdown:\n" + proc.communicate()[0])
    assert proc.returncode != 0, out
    assert "is stalled for longer than 2 seconds. Will shutdown." in out, out
    if stalled == 0:  # rank 0 itself is stuck: it aborts while running
        assert "calling MPI_Abort so that mpirun stops every rank" in out, out
    else:  # rank 0 exits and waits in MPI_Finalize for the stalled rank
        assert "this process ends on SIGALRM so that mpirun stops every rank" in out, out
    if stalled != 0:
        assert "rank 0: ShutdownError" in out, out
    assert time.monotonic() - t0 < 40
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
    assert not left.strip(), left
