"""ssh command lines for remote workers, and the pre-launch ssh reachability check.

Remote command (Horovod's form):
`ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no [-p port] [-i key] -- <host>
'cd <cwd> > /dev/null 2>&1 ; <cmd>'`, where <cmd> runs `launcher.remote_exec`, which reads the
worker's environment and the job secret from stdin (never from the command line). Host
lists refuse names that start with `-` (`launcher.hosts`, discovery output); the `--` is a
second guard, so that no host is ever read as an ssh option such as `-E<file>` or `-F<config>`.
"""
from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ._proc import killpg_quiet

__all__ = ["ssh_base", "remote_command", "ssh_worker_argv", "check_hosts", "timeout_message",
           "SSHCheckError", "StartTimeoutError"]


class SSHCheckError(RuntimeError):
    """Raised when some hosts cannot be reached over ssh."""


class StartTimeoutError(TimeoutError):
    """Raised when the job did not start within --start-timeout."""


def timeout_message(activity: str) -> str:
    """Horovod's `--start-timeout` message."""
    return (f"Timed out waiting for {activity}. Please check connectivity between servers. You "
            f"may need to increase the --start-timeout parameter if you have too many servers.")


def ssh_base(host: str, port: int | None = None, identity_file: str | None = None,
             connect_timeout: float | None = None) -> list[str]:
    """`ssh` and its options, `--`, then the host (never read as an option)."""
    argv = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
    if connect_timeout is not None:
        argv += ["-o", f"ConnectTimeout={max(1, math.ceil(connect_timeout))}"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file is not None:
        argv += ["-i", identity_file]
    argv += ["--", host]
    return argv


def _launcher_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def remote_command(command: Sequence[str], cwd: str, python: str | None = None,
                   launcher_root: str | None = None) -> str:
    """The shell text ssh runs remotely: cd, then the wrapper, then the user's command.

    The wrapper is imported from the launcher's own source root (put first on sys.path), so
    it works whether ringvod is installed or run from a checkout.
    """
    py = python or sys.executable
    root = launcher_root or _launcher_root()
    boot = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
            "from launcher.remote_exec import main; sys.exit(main())")
    return (f"cd {shlex.quote(cwd)} > /dev/null 2>&1 ; exec {shlex.quote(py)} -c "
            f"{shlex.quote(boot)} {shlex.quote(root)} -- {shlex.join(command)}")


def ssh_worker_argv(host: str, command: Sequence[str], cwd: str, port: int | None = None,
                    identity_file: str | None = None) -> list[str]:
    """The full local argv that runs `command` on `host` through the remote wrapper."""
    return ssh_base(host, port, identity_file) + [remote_command(command, cwd)]


def check_hosts(hosts: Sequence[str], timeout: float, port: int | None = None,
                identity_file: str | None = None) -> None:
    """Runs `ssh <host> true` on every host in parallel, all within `timeout` seconds.

    Raises:
        StartTimeoutError: some host did not answer in time (Horovod's message).
        SSHCheckError: ssh failed for some host; its output is printed first.
    """
    if not hosts:
        return
    deadline = time.monotonic() + timeout
    lock = threading.Lock()  # guards procs and stopped
    procs: list[subprocess.Popen[bytes]] = []
    stopped = threading.Event()

    def probe(host: str) -> tuple[str, int | None, str]:
        argv = ssh_base(host, port, identity_file, connect_timeout=timeout) + ["true"]
        with lock:
            if stopped.is_set():
                return host, None, ""
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
        try:
            out, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return host, None, ""
        return host, p.returncode, out.decode(errors="replace")

    pool = ThreadPoolExecutor(max_workers=min(32, len(hosts)),
                              thread_name_prefix="hvdrun-ssh-check")
    try:
        results = list(pool.map(probe, hosts))
    except BaseException:
        # Ctrl-C: stop the probes now, or the pool's shutdown below waits for each of them
        # until --start-timeout (the ssh clients are in their own sessions: no SIGINT there).
        with lock:
            stopped.set()
            for p in procs:
                if p.returncode is None:
                    killpg_quiet(p.pid, signal.SIGKILL)  # ssh and whatever it started
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    timed_out = [h for h, rc, _ in results if rc is None]
    failed = [(h, out) for h, rc, out in results if rc not in (None, 0)]
    for h, out in failed:
        sys.stderr.write(f"ssh not successful for host {h}:\n{out}\n")
    if timed_out:
        raise StartTimeoutError(timeout_message(f"ssh connection to {', '.join(timed_out)}"))
    if failed:
        raise SSHCheckError(
            f"could not connect to some hosts via ssh ({', '.join(h for h, _ in failed)}); "
            f"check that passwordless ssh works (e.g. `ssh {failed[0][0]} true`), and -p/-i")
