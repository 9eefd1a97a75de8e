"""MPI mode's job: `mpirun` as a child of `hvdrun`, with tcp mode's output and signal handling.

* Output: Open MPI tags each rank's line `[<job>,<rank>]<stdout>: `; `hvdrun` rewrites the tag
  to tcp mode's `[<rank>]<stdout>:` (with `-prefix-timestamp`, the time first) and writes it to
  its own stdout/stderr. mpirun's own lines pass through unchanged. MPICH's `-l` tags
  (`[<rank>] `) are rewritten the same way.
* Signals: mpirun runs in its own session, so a terminal's Ctrl-C reaches only `hvdrun`, which
  prints one line, sends mpirun SIGTERM (mpirun stops the ranks), hides mpirun's teardown
  noise (`PMIX ERROR: ...`), and exits with 128 + the signal (130 for Ctrl-C), as in tcp mode.
  A second Ctrl-C, or mpirun still running after the grace period, gets SIGKILL: mpirun and
  everything in its session, which includes its `ssh` clients (each in a process group of its
  own) and whatever mpirun left behind when it ended, however it ended.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from . import mpi_cleanup
from ._proc import catch_signals, has_exited, kill_session, pdeathsig_preexec
from .settings import LaunchSettings

__all__ = ["run_mpi_job", "rewrite_tag", "GRACE_PERIOD_S"]

GRACE_PERIOD_S = 5.0

_OMPI_TAG = re.compile(rb"^\[\d+,(\d+)\]<(stdout|stderr)>: ?")
_HYDRA_TAG = re.compile(rb"^\[(\d+)\] ")


def rewrite_tag(line: bytes, stream: str) -> tuple[int | None, bytes]:
    """(rank, text without mpirun's tag), or (None, line) for a line of mpirun's own."""
    m = _OMPI_TAG.match(line)
    if m is not None:
        return int(m.group(1)), line[m.end():]
    m = _HYDRA_TAG.match(line)
    if m is not None:
        return int(m.group(1)), line[m.end():]
    return None, line


class _Console:
    def __init__(self, prefix_timestamp: bool) -> None:
        self._lock = threading.Lock()
        self._ts = prefix_timestamp
        self.quiet_own_lines = False  # set once hvdrun is stopping the job

    def line(self, stream: str, raw: bytes) -> None:
        rank, text = rewrite_tag(raw, stream)
        if rank is None:
            if self.quiet_own_lines:
                return  # mpirun's teardown noise after an interrupt
            out = text
        else:
            prefix = f"[{rank}]<{stream}>:"
            if self._ts:
                prefix = time.strftime("%a %b %d %H:%M:%S %Y") + prefix
            out = prefix.encode() + text
        if not out.endswith(b"\n"):
            out += b"\n"
        self.write(stream, out.decode("utf-8", errors="replace"))

    def write(self, stream: str, text: str) -> None:
        f = sys.stdout if stream == "stdout" else sys.stderr
        with self._lock:
            try:
                f.write(text)
                f.flush()
            except (OSError, ValueError):
                pass


def run_mpi_job(settings: LaunchSettings, argv: list[str], env: dict[str, str],
                grace_period: float = GRACE_PERIOD_S) -> int:
    """Runs `argv` (an mpirun command from `launch.mpi_command`) to completion.

    Returns:
        mpirun's exit code, or 128 + signal number when hvdrun was interrupted.

    Raises:
        OSError: mpirun cannot be started.
    """
    if settings.verbose:
        sys.stderr.write("hvdrun: " + shlex.join(argv) + "\n")  # names only, never values
    console = _Console(settings.prefix_timestamp)
    events: list[int] = []
    wake = threading.Event()
    main = threading.current_thread() is threading.main_thread()
    old: dict[int, Any] = {}
    if main:
        old = catch_signals(lambda s, _f: (events.append(s), wake.set()))
    before = mpi_cleanup.candidates()
    mpi_cleanup.clean_stale()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=pdeathsig_preexec)
    pumps = [threading.Thread(target=_pump, args=(console, name, pipe),
                              name=f"hvdrun-mpirun-{name}", daemon=True)
             for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for t in pumps:
        t.start()
    interrupted: int | None = None
    deadline: float | None = None
    try:
        # mpirun is reaped only after its session is cleared: until then its pid cannot be
        # reused, so the session id names only what it started.
        while not has_exited(proc.pid):
            wake.wait(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
            wake.clear()
            if events and interrupted is None:
                interrupted = events[0]
                console.quiet_own_lines = True
                console.write("stderr", f"hvdrun: received {signal.Signals(interrupted).name}; "
                                        "stopping all workers.\n")
                os.kill(proc.pid, signal.SIGTERM)  # (Popen.send_signal would reap it)
                deadline = time.monotonic() + grace_period
            elif interrupted is not None and (len(events) > 1 or time.monotonic() >= deadline):
                kill_session(proc.pid)
                deadline = float("inf")
    finally:
        kill_session(proc.pid)  # mpirun if still running, and its leftovers
        code = proc.wait()
        for t in pumps:
            t.join(2.0)
        mpi_cleanup.clean_after(before, proc.pid)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if interrupted is not None:
        return 128 + int(interrupted)
    return code if code >= 0 else 128 - code


def _pump(console: _Console, stream: str, pipe: IO[bytes] | None) -> None:
    if pipe is None:
        return
    try:
        for line in iter(pipe.readline, b""):
            console.line(stream, line)
    except (OSError, ValueError):
        pass
