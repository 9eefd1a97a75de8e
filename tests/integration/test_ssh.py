"""Multi-host hvdrun over REAL ssh: the tests start an `sshd` on 127.0.0.2 (a loopback address
that is not one of this machine's interface addresses, so hvdrun treats it as a remote host).

Needs `sshd`, `ssh` and `ssh-keygen` (Debian: `apt-get install openssh-server
openssh-client`). Skipped when they are missing, unless RINGVOD_TEST_REQUIRE contains `ssh`,
which turns the skip into a failure (CI).
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

try:  # tests/integration as a package, or as a plain directory on sys.path
    from .test_launcher import (REPO, WORKER, _env, explain, hvdrun_argv, rank_envs,
                                read_pids, run_hvdrun, wait_gone)
except ImportError:
    from test_launcher import (REPO, WORKER, _env, explain, hvdrun_argv, rank_envs,
                               read_pids, run_hvdrun, wait_gone)

REQUIRE = os.environ.get("RINGVOD_TEST_REQUIRE", "")
REMOTE = "127.0.0.2"


@dataclass(frozen=True)
class SSHD:
    host: str
    port: int
    key: str

    def args(self) -> list[str]:
        return ["-p", str(self.port), "-i", self.key]


def _skip_or_fail(reason: str) -> None:
    if "ssh" in REQUIRE:
        pytest.fail(f"RINGVOD_TEST_REQUIRE=ssh but {reason}")
    pytest.skip(reason)


def _sshd_binary() -> str | None:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    binary = _sshd_binary()
    if binary is None or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        _skip_or_fail("sshd/ssh/ssh-keygen not installed (apt-get install openssh-server "
                      "openssh-client)")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)],
                       check=True, timeout=30)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    probe = socket.socket()
    try:
        probe.bind((REMOTE, 0))
    except OSError as exc:
        _skip_or_fail(f"cannot bind {REMOTE}: {exc}")
    port = probe.getsockname()[1]
    probe.close()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress {REMOTE}\nHostKey {d / 'host_key'}\n"
        f"PidFile {d / 'sshd.pid'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nLogLevel ERROR\n"
        f"AllowUsers {getpass.getuser()}\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    log = open(d / "sshd.log", "wb")
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = SSHD(REMOTE, port, str(d / "user_key"))
    try:
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run(["ssh", "-o", "PasswordAuthentication=no", "-o",
                                "StrictHostKeyChecking=no", "-o", "ConnectTimeout=5",
                                *server.args()[:2], "-i", server.key, REMOTE, "true"],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                _skip_or_fail(f"test sshd did not come up: {r.stderr.strip()} / "
                              f"{(d / 'sshd.log').read_text(errors='replace')}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # StrictHostKeyChecking=no recorded this throw-away host key; forget it again.
        subprocess.run(["ssh-keygen", "-R", f"[{REMOTE}]:{port}"], capture_output=True,
                       timeout=30)


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    p = tmp_path / "worker.py"
    p.write_text(WORKER)
    return p


@pytest.mark.timeout(120)
def test_two_hosts_over_ssh(sshd, worker, tmp_path):
    env = _env()
    env["CUDA_VISIBLE_DEVICES"] = "0"
    env["NCCL_NVLS_ENABLE"] = "0"
    env["RINGVOD_TEST_MARK"] = "a \"b\" 'c' $HOME"
    r = run_hvdrun("-np", "3", "-H", f"localhost:1,{REMOTE}:2", *sshd.args(), "--tcp",
                   "--cycle-time-ms", "4", sys.executable, str(worker), "env", env=env,
                   cwd=tmp_path)
    assert r.returncode == 0, explain(r)
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1, 2], explain(r)
    expect = {0: ("localhost", 0, 1, 0, 2), 1: (REMOTE, 0, 2, 1, 2), 2: (REMOTE, 1, 2, 0, 1)}
    for rank, e in envs.items():
        host, lr, ls, cr, cs = expect[rank]
        assert (e["HOROVOD_HOSTNAME"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"],
                e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) == (
            host, str(lr), str(ls), str(cr), str(cs))
        assert e["HOROVOD_RANK"] == str(rank) and e["HOROVOD_SIZE"] == "3"
        assert e["HOROVOD_SECRET_KEY"] == envs[0]["HOROVOD_SECRET_KEY"]
        assert e["HOROVOD_GLOO_RENDEZVOUS_PORT"] == envs[0]["HOROVOD_GLOO_RENDEZVOUS_PORT"]
        assert e["HOROVOD_CYCLE_TIME"] == "4.0"
        assert e["NCCL_NVLS_ENABLE"] == "0"
        assert e["RINGVOD_TEST_MARK"] == "a \"b\" 'c' $HOME"
        assert e["__cwd__"] == str(tmp_path)  # remote workers start in the launcher's cwd
    # This machine's GPU mask is not forced on other hosts.
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in envs[1] and "CUDA_VISIBLE_DEVICES" not in envs[2]
    assert "[2]<stderr>:to stderr from 2" in r.stderr


def _cmdlines() -> list[bytes]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f.read())
            except OSError:
                pass
    return out


@pytest.mark.timeout(120)
def test_secret_never_on_a_command_line(sshd, worker):
    proc = subprocess.Popen(
        hvdrun_argv("-np", "2", "-H", f"localhost:1,{REMOTE}:1", *sshd.args(), "--tcp",
                    sys.executable, str(worker), "envsleep", "4"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while sum("ENV {" in l for l in lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        envs = rank_envs("".join(lines))
        assert sorted(envs) == [0, 1], "".join(lines)
        secret = envs[0]["HOROVOD_SECRET_KEY"].encode()
        assert envs[1]["HOROVOD_SECRET_KEY"].encode() == secret
        # Both workers (and the ssh client, sshd, the remote wrapper) are running now.
        leaks = [c.replace(b"\0", b" ")[:200] for c in _cmdlines() if secret in c]
        assert not leaks, leaks
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out, err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", [0, 1], ids=["local-fails", "remote-fails"])
def test_fail_fast_across_hosts(sshd, worker, tmp_path, failing):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    t = time.monotonic()
    r = run_hvdrun("-np", "2", "-H", f"localhost:1,{REMOTE}:1", *sshd.args(), "--tcp",
                   sys.executable, str(worker), "hang", str(piddir), str(failing), "4")
    assert time.monotonic() - t < 25, explain(r)
    assert r.returncode == 4, explain(r)
    host = "localhost" if failing == 0 else REMOTE
    assert f"Process name: {failing}\nExit code: 4\nHost: {host}\n" in r.stderr, explain(r)
    pids = [p for ps in read_pids(piddir).values() for p in ps]
    assert len(pids) == 4
    # The other rank and both grandchildren are gone, on the "remote" host too.
    assert not wait_gone(pids), f"left running: {wait_gone(pids, 0)}\n{explain(r)}"


@pytest.mark.timeout(120)
def test_ctrl_c_stops_remote_workers(sshd, worker, tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc = subprocess.Popen(
        hvdrun_argv("-np", "3", "-H", f"localhost:1,{REMOTE}:2", *sshd.args(), "--tcp",
                    sys.executable, str(worker), "hang", str(piddir), "-1", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(read_pids(piddir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    pids = [p for ps in read_pids(piddir).values() for p in ps]
    assert not wait_gone(pids), f"orphans: {wait_gone(pids, 0)}\n{out}\n{err}"


@pytest.mark.timeout(60)
def test_ssh_failure_is_reported(sshd, worker, tmp_path):
    bad_key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(bad_key)],
                   check=True, timeout=30)
    r = run_hvdrun("-np", "2", "-H", f"localhost:1,{REMOTE}:1", "-p", str(sshd.port), "-i",
                   str(bad_key), "--tcp", sys.executable, str(worker), "env")
    assert r.returncode != 0, explain(r)
    assert f"ssh not successful for host {REMOTE}:" in r.stderr, explain(r)
    assert "could not connect to some hosts via ssh" in r.stderr
    assert "ENV {" not in r.stdout


@pytest.mark.timeout(120)
def test_horovod_run_over_ssh(sshd):
    code = (
        "import os\nfrom launcher.api import run\n"
        f"res = run(lambda x: (int(os.environ['HOROVOD_RANK']), os.environ['HOROVOD_HOSTNAME'],"
        f" x * 2), args=(21,), num_proc=2, hosts='localhost:1,{REMOTE}:1', "
        f"ssh_port={sshd.port}, ssh_identity_file={sshd.key!r}, use_gloo=True)\n"
        "print('RESULT', res)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=90, env=_env(), cwd=REPO)
    assert r.returncode == 0, explain(r)
    assert f"RESULT [(0, 'localhost', 42), (1, '{REMOTE}', 42)]" in r.stdout, explain(r)


@pytest.mark.timeout(120)
def test_allreduce_over_ssh(sshd):
    """The runtime's tcp mode across a local and an ssh-launched rank."""
    if not (REPO / "collective" / "engines" / "tcp").is_dir():
        pytest.skip("tcp engine not present in this tree")
    r = run_hvdrun("-np", "3", "-H", f"localhost:1,{REMOTE}:2", *sshd.args(), "--tcp",
                   sys.executable, "examples/hello_allreduce.py", timeout=90)
    assert r.returncode == 0, explain(r)
    for rank in range(3):
        assert re.search(rf"^\[{rank}\]<stdout>:rank {rank}/3 .*mode tcp\): allreduce sum = 3$",
                         r.stdout, re.M), explain(r)


@pytest.mark.timeout(120)
def test_elastic_job_on_a_loopback_host_over_ssh(sshd, tmp_path):
    """Discovery finds only 127.0.0.2, reached over ssh: the rendezvous server listens on
    127.0.0.1, which the workers there reach, so the job runs and hvdrun warns of nothing."""
    from tests._elastic_job import Job  # noqa: PLC0415 - only this test runs an elastic job

    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho {REMOTE}:2\n")
    script.chmod(0o755)
    job = Job(out, ["-np", "2", "--min-np", "2", "--host-discovery-script", str(script),
                    *sshd.args()], {"ET_STEPS": "6", "ET_SLEEP": "0.01"}, timeout=90)
    code, text = job.finish()
    assert code == 0, text
    assert "warning" not in text, text
    assert sorted(r["size"] for r in job.results()) == [2, 2], text
