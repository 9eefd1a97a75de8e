"""How the elastic driver starts and stops worker processes.

The driver needs only this small interface (`WorkerSpawner`), so other front ends can start
workers their own way (e.g. as Ray actors):

    spawn(worker_id, hostname, env, on_exit)   start one worker; call on_exit(worker_id,
                                               exit_code, signal_name) from any thread when
                                               it ends (exit code 128 + n for signal n)
    stop(worker_id, sig)                       signal it (SIGTERM, then SIGKILL)
    close()                                    kill what is left, reap, join threads

`ProcessSpawner` is hvdrun's: local workers are child processes in their own sessions, remote
ones run under `ssh ... launcher.remote_exec` with their environment (secret included) written
to the ssh channel's stdin. Output lines are prefixed `[<worker>]<stdout>:`, where workers are
numbered in the order they were started (the first ones get the numbers of their first ranks).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import IO, Callable, Protocol, Sequence

from .. import network, ssh
from .._proc import killpg_quiet, pdeathsig_preexec, wait_no_reap
from ..process import _Output, join_all
from ..remote_exec import payload

__all__ = ["WorkerSpawner", "ProcessSpawner", "OnExit"]

OnExit = Callable[[int, int, "str | None"], None]


class WorkerSpawner(Protocol):
    def spawn(self, worker_id: int, hostname: str, env: dict[str, str],
              on_exit: OnExit) -> None: ...

    def stop(self, worker_id: int, sig: int) -> None: ...

    def close(self) -> None: ...


class ProcessSpawner:
    """Starts `command` once per worker, locally or over ssh.

    Args:
        command: the worker command line.
        parent_env: the launcher's environment (ssh workers get it minus host-specific
            variables; `env` passed to `spawn` is the worker's complete environment).
        output_dir: `--output-filename`: also write DIR/rank.<worker>/{stdout,stderr}.
    """

    def __init__(self, command: Sequence[str], parent_env: dict[str, str], *,
                 ssh_port: int | None = None, ssh_identity_file: str | None = None,
                 output_dir: str | None = None, prefix_timestamp: bool = False,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 width_hint: int = 1) -> None:
        self.command = list(command)
        self.parent_env = parent_env
        self.ssh_port, self.ssh_identity_file = ssh_port, ssh_identity_file
        self._out = _Output(stdout or sys.stdout, stderr or sys.stderr, prefix_timestamp,
                            output_dir, max(width_hint, 1))
        self._local = network.local_addresses()
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._threads: list[threading.Thread] = []
        self._cwd = os.getcwd()

    def message(self, text: str) -> None:
        """A driver message, written to stderr between worker lines."""
        self._out.message(text)

    def is_remote(self, hostname: str) -> bool:
        return not network.is_local_host(hostname, self._local)

    def spawn(self, worker_id: int, hostname: str, env: dict[str, str],
              on_exit: OnExit) -> None:
        remote = self.is_remote(hostname)
        stdin_payload = None
        if remote:
            argv = ssh.ssh_worker_argv(hostname, self.command, self._cwd, self.ssh_port,
                                       self.ssh_identity_file)
            popen_env, stdin_payload = dict(self.parent_env), payload(env)
        else:
            argv, popen_env = list(self.command), env
        try:
            self._out.open_rank(worker_id)  # --output-filename: may refuse a planted path
            proc = subprocess.Popen(
                argv, env=popen_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if stdin_payload is not None else subprocess.DEVNULL,
                start_new_session=True, preexec_fn=pdeathsig_preexec, close_fds=True)
        except OSError as exc:
            self._out.message(f"hvdrun: cannot start worker {worker_id} on {hostname}: {exc}")
            on_exit(worker_id, 127, None)
            return
        with self._lock:
            self._procs[worker_id] = proc
        assert proc.stdout is not None and proc.stderr is not None
        targets = [(self._pump, (worker_id, "stdout", proc.stdout)),
                   (self._pump, (worker_id, "stderr", proc.stderr)),
                   (self._wait, (worker_id, proc.pid, on_exit))]
        if stdin_payload is not None:
            targets.append((self._feed, (proc, stdin_payload)))
        for target, args in targets:
            t = threading.Thread(target=target, args=args, daemon=True,
                                 name=f"hvdrun-worker{worker_id}-{target.__name__.strip('_')}")
            t.start()
            with self._lock:
                self._threads.append(t)

    def stop(self, worker_id: int, sig: int) -> None:
        with self._lock:
            proc = self._procs.get(worker_id)
        if proc is None or proc.returncode is not None:
            return
        if sig == signal.SIGTERM and proc.stdin is not None:
            try:
                proc.stdin.close()  # the remote wrapper stops its command on EOF
            except OSError:
                pass
        killpg_quiet(proc.pid, sig)

    def close(self) -> None:
        with self._lock:
            procs = list(self._procs.values())
            threads = list(self._threads)
        for proc in procs:  # each leader's group: whatever a worker left behind goes too
            if proc.returncode is None:
                killpg_quiet(proc.pid, signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        join_all(threads, 2.0, self._out.stop_pumps)
        for proc in procs:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
        self._out.close()

    # -- threads ------------------------------------------------------------------------------
    def _pump(self, worker_id: int, stream: str, pipe: IO[bytes]) -> None:
        self._out.pump(worker_id, stream, pipe)

    @staticmethod
    def _wait(worker_id: int, pid: int, on_exit: OnExit) -> None:
        code, sig_name = wait_no_reap(pid)
        on_exit(worker_id, code, sig_name)

    @staticmethod
    def _feed(proc: subprocess.Popen[bytes], data: bytes) -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(data)
            proc.stdin.flush()
        except (OSError, ValueError):
            pass
