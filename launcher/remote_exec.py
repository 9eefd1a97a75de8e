"""Remote side of an ssh worker: `python -m launcher.remote_exec <command...>`, started by ssh.

The launcher writes one JSON line to the ssh channel's stdin: `{"env": {...}}`, the worker's
environment including the job secret, which so never appears on a command line (visible in
`ps` on either host). This wrapper then

* runs the command in its own session with that environment on top of the login environment;
* keeps reading stdin: EOF means the launcher stopped the job or died (the ssh connection is
  gone), and the command's whole process group is stopped (SIGTERM, SIGKILL after the grace
  period) — without a terminal, ssh would otherwise leave remote workers running;
* forwards SIGTERM/SIGINT/SIGHUP the same way;
* exits with the command's exit code (128 + signal number for a death by signal).

Threads: `remote-exec-stdin` (reads stdin to EOF; daemon because it blocks in read and the
process exits right after the command does).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from ._proc import killpg_quiet, pdeathsig_preexec, wait_no_reap

__all__ = ["main", "payload"]

GRACE_PERIOD_S = 5.0


def payload(env: dict[str, str]) -> bytes:
    """The stdin line the launcher sends to this wrapper."""
    return (json.dumps({"env": env}, separators=(",", ":")) + "\n").encode()


def _read_line(fd: int) -> bytes:
    # Byte-wise, unbuffered: nothing after the line may be consumed by a buffer here.
    chunks = bytearray()
    while True:
        b = os.read(fd, 1)
        if not b or b == b"\n":
            return bytes(chunks)
        chunks += b


class _Stopper:
    """Stops the command's process group once: SIGTERM, then SIGKILL after the grace period."""

    def __init__(self, pgid: int) -> None:
        self._pgid = pgid
        self._lock = threading.Lock()  # guards _started
        self._started = False

    def stop(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        killpg_quiet(self._pgid, signal.SIGTERM)
        timer = threading.Timer(GRACE_PERIOD_S, killpg_quiet, (self._pgid, signal.SIGKILL))
        timer.name = "remote-exec-kill"
        timer.daemon = True
        timer.start()


def _watch_stdin(stopper: _Stopper) -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    stopper.stop()


def main(argv: list[str] | None = None) -> int:
    """Runs the command given in argv with the env read from stdin; returns its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        sys.stderr.write("remote_exec: no command given\n")
        return 2
    line = _read_line(0)
    if not line.strip():
        # stdin closed before the launcher sent the environment: it stopped the job (or died)
        # meanwhile. Nothing runs, rather than the command without the job's environment.
        sys.stderr.write("remote_exec: no environment on stdin (the launcher stopped); not "
                         "starting the command\n")
        return 2
    try:
        data: dict[str, Any] = json.loads(line.decode())
    except ValueError:
        sys.stderr.write("remote_exec: malformed environment payload on stdin\n")
        return 2
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in data.get("env", {}).items()})
    try:
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=pdeathsig_preexec)
    except OSError as exc:
        sys.stderr.write(f"remote_exec: cannot start {args[0]!r}: {exc}\n")
        return 127
    stopper = _Stopper(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda _s, _f: stopper.stop())
    threading.Thread(target=_watch_stdin, args=(stopper,), name="remote-exec-stdin",
                     daemon=True).start()
    code, _ = wait_no_reap(proc.pid)
    # Leftovers of the command (its group outlives it while the leader is an unreaped zombie).
    killpg_quiet(proc.pid, signal.SIGKILL)
    proc.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
