"""The stall check's shutdown (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) must end an MPI-mode job.

The stalled rank never reaches MPI_Finalize, and Open MPI's finalize waits for every rank: the
other ranks, after their ShutdownError, hung there, and mpirun, seeing no rank exit, never
ended the job. The rank that decides the shutdown (a set's rank 0, or in per-gradient mode a
rank whose gradients wait) now ends the job if it is still stuck a few seconds later:
MPI_Abort while it runs (it stalled itself), SIGALRM once it waits in MPI_Finalize (the
stalled rank is another). A job whose ranks all end by themselves exits as usual
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


# Per-gradient mode (HOROVOD_BUCKET_CAP_MB=0): the optimizer's gradient set on rank 1 waits
# for rank 0's gradients; its own stall check asks for the shutdown.
GRADSET_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import horovod.torch as hvd
    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    try:
        for step in range(2):  # the second step's gradients travel as set bits only
            if step == 1 and hvd.rank() == STALLED:
                time.sleep(300)  # a rank stuck before its backward
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()}: {type(exc).__name__}", flush=True)
        sys.exit(1)
""")


@pytest.mark.parametrize("stalled,script_text", [(1, SCRIPT), (0, SCRIPT), (0, GRADSET_SCRIPT)],
                         ids=["rank1", "rank0", "gradient-set"])
def test_stall_shutdown_ends_the_mpi_job(tmp_path: Path, stalled: int, script_text: str) -> None:
    reason = mpi_available()
    if reason:
        skip_or_fail(reason, "mpi")
    gradset = script_text is GRADSET_SCRIPT
    if gradset:
        pytest.importorskip("torch")
    script = tmp_path / "stall.py"
    script.write_text(script_text.replace("STALLED", str(stalled)))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2",
               HOROVOD_BUCKET_CAP_MB="0", PYTHONFAULTHANDLER="1")
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
    if not gradset:
        assert "is stalled for longer than 2 seconds. Will shutdown." in out, out
    if stalled == 0 and not gradset:  # rank 0 decides and is the stuck one: it aborts
        assert "calling MPI_Abort so that mpirun stops every rank" in out, out
    else:  # the deciding rank exits and waits in MPI_Finalize for the stalled one
        assert "this process ends on SIGALRM so that mpirun stops every rank" in out, out
    if stalled != 0:
        assert "rank 0: StallError" in out, out  # a ShutdownError naming the stall
    assert time.monotonic() - t0 < 40
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
    assert not left.strip(), left
