"""hvdrun's MPI launch: Open MPI's saturating `op/avx` component is excluded unless the user
chose the reduction components, and leftovers of killed Open MPI jobs are cleaned up."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from launcher.hosts import HostInfo
from launcher.mpirun import build_mpirun_command, parse_mpi_version

OMPI5 = parse_mpi_version("mpirun (Open MPI) 5.0.11\n")
OMPI40 = parse_mpi_version("mpirun (Open MPI) 4.0.7\n")
HOSTS = [HostInfo("localhost", 2)]


def _argv(impl=OMPI5, env=None, mpi_args=None) -> list[str]:
    return build_mpirun_command(impl, num_proc=2, hosts=HOSTS, command=["x"], env=env or {},
                                mpi_args=mpi_args)


def _has_op_exclusion(argv: list[str]) -> bool:
    return any(argv[i:i + 3] == ["-mca", "op", "^avx"] for i in range(len(argv)))


def test_open_mpi_launch_excludes_the_saturating_avx_op(monkeypatch) -> None:
    monkeypatch.delenv("OMPI_MCA_op", raising=False)
    assert _has_op_exclusion(_argv())
    assert not _has_op_exclusion(_argv(OMPI40))  # no such component before 4.1


@pytest.mark.parametrize("how", ["env", "mca", "dash-dash-mca"])
def test_a_users_own_op_setting_is_kept(how, monkeypatch) -> None:
    monkeypatch.delenv("OMPI_MCA_op", raising=False)
    if how == "env":
        argv = _argv(env={"OMPI_MCA_op": "avx"})
    else:
        flag = "-mca" if how == "mca" else "--mca"
        argv = _argv(mpi_args=f"{flag} op avx")
        assert argv[-4:-1] == [flag, "op", "avx"]
    assert not _has_op_exclusion(argv)


# -- leftovers of killed Open MPI jobs ----------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_job(shm, tmp, host: str, jobid: int, age: float) -> tuple[str, str]:
    seg = shm / f"sm_segment.{host}.{os.getuid()}.{jobid:x}.0"
    seg.write_bytes(b"\0" * 4096)
    job = tmp / f"ompi.{host}.{os.getuid()}" / "jf.0" / str(jobid)
    job.mkdir(parents=True)
    (job / "x").write_text("x")
    old = time.time() - age
    os.utime(seg, (old, old))
    return str(seg), str(job)


def test_stale_leftovers_are_removed_and_live_ones_kept(tmp_path, capsys) -> None:
    from launcher import mpi_cleanup
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead_seg, dead_job = _fake_job(shm, tmp, "h", 0x15AA0000, 3600)
    young_seg, young_job = _fake_job(shm, tmp, "h", 0x15AB0000, 0)  # being set up right now
    used_seg, used_job = _fake_job(shm, tmp, "h", 0x15AC0000, 3600)
    dead_dir = tmp / f"ompi.{_dead_pid()}"
    dead_dir.mkdir()
    live_dir = tmp / f"ompi.{os.getpid()}"
    live_dir.mkdir()
    with open(used_seg, "rb") as held:  # a live process holds this job's segment
        removed = mpi_cleanup.clean_stale(str(shm), str(tmp), "h")
        assert os.path.exists(used_seg) and os.path.exists(used_job)
        del held
    assert sorted(removed) == sorted([dead_seg, dead_job, str(dead_dir)])
    for p in (dead_seg, dead_job, dead_dir):
        assert not os.path.exists(p)
    for p in (young_seg, young_job, live_dir):
        assert os.path.exists(p)
    err = capsys.readouterr().err
    assert "removed 3 Open MPI leftover(s)" in err and dead_seg in err


def test_after_its_own_mpirun_only_new_unused_leftovers_go(tmp_path, capsys) -> None:
    from launcher import mpi_cleanup
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    older_seg, _ = _fake_job(shm, tmp, "h", 0x100000, 3600)  # not ours: there before
    before = mpi_cleanup.candidates(str(shm), str(tmp), "h")
    pid = _dead_pid()
    (tmp / f"ompi.{pid}").mkdir()
    ours_seg, ours_job = _fake_job(shm, tmp, "h", 0x200000, 0)  # fresh: no age needed
    removed = mpi_cleanup.clean_after(before, pid, str(shm), str(tmp), "h")
    assert sorted(removed) == sorted([ours_seg, ours_job, str(tmp / f"ompi.{pid}")])
    assert os.path.exists(older_seg)
    assert f"mpirun pid {pid}" in capsys.readouterr().err


_SLEEPER = r"""
import os, sys, time, numpy as np, collective as hvd
hvd.init()
hvd.allreduce(np.ones(10), name="warm")
print("UP", os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_hvdrun_cleans_up_after_its_killed_mpirun(tmp_path) -> None:
    """SIGKILL of mpirun and the ranks leaves /dev/shm segments and /tmp/ompi.<pid>; hvdrun,
    mpirun's parent, removes them once mpirun has ended and says so."""
    import shutil
    import signal
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    from tests._spmd import REPO
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    env["PYTHONPATH"] = REPO
    log = open(tmp_path / "hvdrun.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "-np", "2", "--mpi",
                             sys.executable, str(script)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline and text.count("UP ") < 2:
            time.sleep(0.2)
            text = (tmp_path / "hvdrun.log").read_text()
        import re
        ranks = [int(m) for m in re.findall(r"UP (\d+)", text)]
        assert len(ranks) == 2, text
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        mpirun = next(int(c) for c in children
                      if "mpirun" in open(f"/proc/{c}/cmdline").read()
                      or "prterun" in open(f"/proc/{c}/cmdline").read())
        session = f"/tmp/ompi.{mpirun}"
        assert os.path.isdir(session), text
        for pid in [mpirun] + ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and os.path.exists(session):
            time.sleep(0.2)
        assert not os.path.exists(session)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "of this job" not in text:
            time.sleep(0.2)
            text = (tmp_path / "hvdrun.log").read_text()
        assert f"of this job (mpirun pid {mpirun})" in text and session in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


# A stand-in for an mpirun that cannot finish its launch (an unreachable host): it starts a
# child in a process group of its own, as Open MPI starts its ssh clients, and then either
# ignores SIGTERM ("stuck") or exits 1 at once, leaving the child behind ("exits").
_STUCK_MPIRUN = r"""
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=os.setpgrp)
print("CHILD", child.pid, flush=True)
if sys.argv[1] == "exits":
    sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""

_RUN_JOB = r"""
import sys
from launcher.hosts import HostInfo
from launcher.mpi_job import run_mpi_job
from launcher.settings import LaunchSettings
settings = LaunchSettings(num_proc=1, hosts=(HostInfo("localhost", 1),), mode="mpi",
                          command=("x",))
sys.exit(run_mpi_job(settings, [sys.executable, sys.argv[1], sys.argv[2]], None,
                     grace_period=0.5))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["stuck", "exits"])
def test_nothing_mpirun_started_outlives_the_job(tmp_path, how) -> None:
    """What mpirun started in a process group of its own (Open MPI's ssh clients) goes with
    it: when hvdrun SIGKILLs an mpirun that ignored SIGTERM (a killpg of mpirun's group left
    the ssh to an unreachable host running for minutes, owned by init), and when mpirun ends
    and leaves it behind."""
    import signal

    from tests._spmd import REPO
    fake = tmp_path / "mpirun.py"
    fake.write_text(_STUCK_MPIRUN)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", _RUN_JOB, str(fake), how], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    child = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("CHILD "), line + proc.stdout.read()
        child = int(line.split()[1])
        if how == "stuck":
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == (143 if how == "stuck" else 1), out
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"mpirun's child {child} outlived the job\n{out}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_mpi_mode_gives_nccl_the_network_interface() -> None:
    # hvdrun --mpi --network-interface ib0: NCCL gets NCCL_SOCKET_IFNAME=ib0 too, as with
    # horovodrun and hvdrun's tcp mode (it only reached Open MPI's btl_tcp_if_include, and NCCL
    # picked an interface of its own, e.g. docker0).
    from launcher import cli, launch
    args = cli.build_parser().parse_args(["-np", "2", "--mpi", "--network-interface", "lo",
                                          "python3", "x.py"])
    argv, env = launch.mpi_command(cli.settings_from_args(args))
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert any(argv[i:i + 2] == ["-x", "NCCL_SOCKET_IFNAME"] for i in range(len(argv)))


def test_ssh_wrapper_runs_nothing_without_the_jobs_environment(tmp_path) -> None:
    # stdin closed before the launcher sent the environment (it stopped the job meanwhile):
    # the command never starts (it ran with the login environment only, as a 1-rank job).
    marker = tmp_path / "ran"
    proc = subprocess.run([sys.executable, "-m", "launcher.remote_exec", "--", "touch",
                           str(marker)], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "no environment on stdin" in proc.stderr, proc.stderr
    assert not marker.exists()
