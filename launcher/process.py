"""Runs a job's workers: spawn, prefix their output, fail fast, stop them all on a signal.

Every worker (a local process, or the local `ssh` client of a remote one) runs in its own
session, so a terminal's Ctrl-C reaches only `hvdrun`, which then stops the workers itself.

Threads (all named, owned by `JobRunner.run`, which joins them before it returns):

| thread | what it does | how it stops |
|---|---|---|
| `hvdrun-rank<r>-stdout/stderr` | copies one pipe, line by line (a piece ending in `\r` too), prefixed `[<r>]<stdout>:` | EOF on the pipe, or 2 s after the last worker exited (`_Output.stop_pumps`) |
| `hvdrun-rank<r>-wait` | waits for the process to exit (without reaping it) | the process exits |
| `hvdrun-rank<r>-stdin` | sends an ssh worker its env and secret | payload written |

Error categories (the first failure is the root cause, the rest is fallout):

| event | reported as |
|---|---|
| a worker exits non-zero or dies by a signal | `Process <r> exit with status code <ec>.`, then all others are stopped |
| a worker cannot be started (e.g. command not found) | the same, exit code 127 |
| SIGINT/SIGTERM to hvdrun | every worker is stopped; exit code 128 + signal |
"""
from __future__ import annotations

import errno
import os
import queue
import re
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator, Sequence

from ._proc import (catch_signals, describe_exit, killpg_quiet, pdeathsig_preexec,
                    wait_no_reap)

__all__ = ["WorkerSpec", "Failure", "JobResult", "JobRunner", "failure_summary",
           "GRACE_PERIOD_S"]

GRACE_PERIOD_S = 5.0  # SIGTERM → SIGKILL


@dataclass
class WorkerSpec:
    """One process to run for one rank."""

    rank: int
    hostname: str
    argv: list[str]
    env: dict[str, str]
    # Written to stdin, which then stays open: an ssh worker's remote wrapper reads its env and
    # the job secret from it, and treats EOF as "stop".
    stdin_payload: bytes | None = None
    remote: bool = False


@dataclass(frozen=True)
class Failure:
    """The first worker that exited non-zero."""

    rank: int
    hostname: str
    exit_code: int
    signal_name: str | None = None


@dataclass(frozen=True)
class JobResult:
    """How a job ended: exit_code 0 means every worker exited 0."""

    exit_code: int
    failure: Failure | None = None
    interrupted_by: str | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)


def failure_summary(failure: Failure) -> str:
    """Horovod's end-of-job text naming the first rank that failed."""
    return (
        "Horovod detected that one or more processes exited with non-zero status, thus causing "
        "the job to be terminated. The first process to do so was:\n"
        f"Process name: {failure.rank}\n"
        f"Exit code: {describe_exit(failure.exit_code, failure.signal_name)}\n"
        f"Host: {failure.hostname}\n")


_LINE_END = re.compile(rb"\r\n|\n|\r")


def _pieces(fd: int, stop: threading.Event) -> Iterator[bytes]:
    """A worker's output in pieces that each end in "\n", "\r\n" or "\r" (the last one, at
    EOF, may end in neither). A piece ending in "\r", a progress bar redrawing its line (tqdm),
    comes out as soon as it is written, as horovodrun shows it, not when a newline ends the
    bar. Ends at EOF, or once `stop` is set and nothing is left to read (a process the worker
    left behind, in a session of its own, may hold the pipe open for ever)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pending = b""
    while True:
        if not poller.poll(200):
            if stop.is_set():
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        start = 0
        for m in _LINE_END.finditer(pending):
            yield pending[start:m.end()]
            start = m.end()
        pending = pending[start:]
    if pending:
        yield pending


class _Output:
    """Writes prefixed worker lines to the console and the raw output to per-rank files."""

    def __init__(self, stdout: IO[str], stderr: IO[str], prefix_timestamp: bool,
                 output_dir: str | None, num_proc: int) -> None:
        self._console: dict[str, IO[str]] = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()  # guards _console and its writes: lines never interleave
        self._prefix_timestamp = prefix_timestamp
        self._files: dict[tuple[int, str], IO[bytes]] = {}
        self._dir = output_dir
        self._width = len(str(max(num_proc - 1, 0)))
        self._stop_pumps = threading.Event()

    def open_rank(self, rank: int) -> None:
        """Creates (or truncates) DIR/rank.<r>/stdout and stderr.

        DIR may be shared with other users: a rank directory or file there that is a symbolic
        link (placed beforehand by someone else) would send the output, and the truncation,
        wherever it points. Neither is followed (O_NOFOLLOW, the files opened relative to the
        rank directory's descriptor); DIR itself, the path the user gave, is.

        Raises:
            OSError: a directory or file cannot be created, or one is a symbolic link (the
                message names it).
        """
        if self._dir is None:
            return
        d = os.path.join(self._dir, f"rank.{rank:0{self._width}d}")
        os.makedirs(self._dir, exist_ok=True)
        try:
            os.mkdir(d)
        except FileExistsError:
            pass  # a directory from an earlier run (or a link: refused just below)
        dfd = _open_no_link(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _check_own(dfd, d, stat.S_ISDIR, "directory")
            for stream in ("stdout", "stderr"):
                path = os.path.join(d, stream)
                # O_NONBLOCK: a FIFO placed there fails (or opens) at once instead of
                # blocking hvdrun; anything but a regular file of ours is then refused.
                fd = _open_no_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK,
                                   dir_fd=dfd)
                try:
                    _check_own(fd, path, stat.S_ISREG, "regular file")
                    os.set_blocking(fd, True)
                except BaseException:
                    os.close(fd)
                    raise
                self._files[(rank, stream)] = os.fdopen(fd, "wb")
        finally:
            os.close(dfd)

    def stop_pumps(self) -> None:
        """Makes every `pump` return as soon as its pipe has nothing to read (within 0.2 s);
        only then may the pipes be closed (a pump reading a closed descriptor could read
        from whatever file reuses its number)."""
        self._stop_pumps.set()

    def pump(self, rank: int, stream: str, pipe: IO[bytes]) -> None:
        """Copies one worker pipe until EOF (or `stop_pumps`), a piece at a time (see
        `_pieces`)."""
        after_cr = False
        try:
            for piece in _pieces(pipe.fileno(), self._stop_pumps):
                # "\r\n" split between two reads: the "\n" ends the line already shown.
                self.line(rank, stream, piece, prefix=not (after_cr and piece == b"\n"))
                after_cr = piece.endswith(b"\r")
        except (OSError, ValueError):
            pass  # pipe closed under us during shutdown

    def line(self, rank: int, stream: str, data: bytes, prefix: bool = True) -> None:
        f = self._files.get((rank, stream))
        if f is not None:
            f.write(data)  # byte for byte: a final line without a newline stays without one
            f.flush()
        if not data.endswith((b"\n", b"\r")):
            data += b"\n"  # the console gets whole prefixed lines
        text = data.decode("utf-8", errors="replace")
        if prefix:
            head = f"[{rank}]<{stream}>:"
            if self._prefix_timestamp:
                head = time.strftime("%a %b %d %H:%M:%S %Y") + head
            text = head + text
        self._write(stream, text)

    def message(self, text: str) -> None:
        self._write("stderr", text if text.endswith("\n") else text + "\n")

    def _write(self, stream: str, text: str) -> None:
        with self._lock:
            out = self._console.get(stream)
            if out is None:
                return
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):
                # e.g. `hvdrun ... | head`: keep draining the workers' pipes (a full pipe would
                # block them), but stop writing to this stream.
                del self._console[stream]

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _check_own(fd: int, path: str, kind: Callable[[int], bool], what: str) -> None:
    """Refuses an opened output path that is not a `what` (by `kind`, a `stat.S_IS*`) owned
    by this user: someone else's directory or file in a shared DIR could be read or replaced
    by its owner."""
    st = os.fstat(fd)
    if not kind(st.st_mode):
        raise OSError(f"--output-filename: {path} is not a {what}; hvdrun writes worker "
                      "output only to its own directories and regular files. Remove it, or "
                      "give a directory that only you can write to.")
    if st.st_uid != os.geteuid():
        raise OSError(f"--output-filename: {path} belongs to uid {st.st_uid}, not to this "
                      f"user (uid {os.geteuid()}); its owner could read or replace the "
                      "output. Remove it, or give a directory that only you can write to.")


def _open_no_link(path: str, flags: int, dir_fd: int | None = None) -> int:
    """`os.open` that refuses a symbolic link as the last component of `path` (with
    `dir_fd`, `path`'s base name is opened relative to it)."""
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if not os.path.islink(path):
            if exc.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK)
                raise OSError(f"--output-filename: {path} is not a regular file; hvdrun "
                              "writes worker output only to its own directories and regular "
                              "files. Remove it, or give a directory that only you can write "
                              "to.") from exc
            raise
        raise OSError(f"--output-filename: {path} is a symbolic link; hvdrun does not write "
                      "worker output through one (it could point anywhere). Remove it, or "
                      "give a directory that only you can write to.") from exc


def join_all(threads: Sequence[threading.Thread], timeout: float,
             stop_pumps: Callable[[], None]) -> None:
    """Joins `threads` within `timeout` seconds; if some are still running then, calls
    `stop_pumps()` and gives them 1 s more (a pump stops within 0.2 s)."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        stop_pumps()
        deadline = time.monotonic() + 1.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit: tuple[int, str | None] | None = None  # set by the main loop only
        self.threads: list[threading.Thread] = []


class JobRunner:
    """Runs one static job to completion (not reusable).

    Args:
        workers: one spec per rank.
        output_dir: `--output-filename`: raw output also goes to DIR/rank.<r>/{stdout,stderr}.
        prefix_timestamp: prefix console lines with the time.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        stdout, stderr: console streams (default: sys.stdout / sys.stderr).
    """

    def __init__(self, workers: Sequence[WorkerSpec], *, output_dir: str | None = None,
                 prefix_timestamp: bool = False, grace_period: float = GRACE_PERIOD_S,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self._workers = [_Worker(w) for w in workers]
        self._out = _Output(stdout or sys.stdout, stderr or sys.stderr, prefix_timestamp,
                            output_dir, len(workers))
        self._grace = grace_period
        self._events: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()

    # --- public -------------------------------------------------------------------------------

    def run(self) -> JobResult:
        """Starts every worker and waits until all have exited.

        Returns:
            The job's result; `exit_code` is 0, the first failed worker's exit code, or 128 +
            signal number when hvdrun was interrupted.

        Raises:
            OSError: an output file cannot be created.
        """
        old_handlers = self._install_signal_handlers()
        try:
            return self._run()
        finally:
            self._stop_all(signal.SIGKILL)  # only does something after an unexpected error
            self._reap_all()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self._out.close()

    # --- internals ----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # horovod.run() from a thread: the caller owns signal handling
        # SimpleQueue.put is reentrant, so a handler may call it while run() blocks in get.
        return catch_signals(lambda s, _f: self._events.put(("signal", s, None)))

    def _run(self) -> JobResult:
        for w in self._workers:
            self._out.open_rank(w.spec.rank)
        # Spawn everything before starting any thread: fork + preexec_fn is safest then.
        for w in self._workers:
            self._spawn(w)
        for w in self._workers:
            self._start_threads(w)

        failure: Failure | None = None
        interrupted: str | None = None
        stopping_since: float | None = None
        killed = False
        running = sum(1 for w in self._workers if w.exit is None)
        while running:
            timeout = None
            if stopping_since is not None and not killed:
                timeout = max(0.0, stopping_since + self._grace - time.monotonic())
            try:
                kind, rank, payload = self._events.get(timeout=timeout)
            except queue.Empty:
                self._stop_all(signal.SIGKILL)
                killed = True
                continue
            if kind == "signal":
                name = signal.Signals(rank).name
                if stopping_since is None:
                    interrupted = name
                    self._out.message(f"hvdrun: received {name}; stopping all workers.")
                    stopping_since = time.monotonic()
                    self._stop_all(signal.SIGTERM)
                elif not killed:  # a second Ctrl-C: no more grace
                    self._stop_all(signal.SIGKILL)
                    killed = True
                continue
            w = self._workers[rank]
            if w.exit is not None:
                continue
            w.exit = payload
            running -= 1
            code, sig_name = payload
            if code != 0 and stopping_since is None:
                failure = Failure(rank, w.spec.hostname, code, sig_name)
                self._out.message(f"Process {rank} exit with status code "
                                  f"{describe_exit(code, sig_name)}.")
                self._out.message(
                    f"Terminating remaining workers after failure of Process {rank}.")
                stopping_since = time.monotonic()
                self._stop_all(signal.SIGTERM)

        self._kill_leftovers()
        self._reap_all()
        self._join_threads()
        codes = {w.spec.rank: w.exit[0] for w in self._workers if w.exit is not None}
        if interrupted is not None:
            return JobResult(128 + int(signal.Signals[interrupted]), failure, interrupted, codes)
        if failure is not None:
            return JobResult(failure.exit_code if 0 < failure.exit_code < 256 else 1, failure,
                             None, codes)
        return JobResult(0, None, None, codes)

    def _spawn(self, w: _Worker) -> None:
        spec = w.spec
        try:
            w.proc = subprocess.Popen(
                spec.argv, env=spec.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if spec.stdin_payload is not None else subprocess.DEVNULL,
                start_new_session=True, preexec_fn=pdeathsig_preexec, close_fds=True)
        except OSError as exc:
            self._out.message(f"hvdrun: cannot start rank {spec.rank} on {spec.hostname}: {exc}")
            self._events.put(("exit", spec.rank, (127, None)))

    def _start_threads(self, w: _Worker) -> None:
        proc = w.proc
        if proc is None:
            return
        r = w.spec.rank
        assert proc.stdout is not None and proc.stderr is not None
        targets: list[tuple[str, Any, tuple[Any, ...]]] = [
            (f"hvdrun-rank{r}-stdout", self._pump, (r, "stdout", proc.stdout)),
            (f"hvdrun-rank{r}-stderr", self._pump, (r, "stderr", proc.stderr)),
            (f"hvdrun-rank{r}-wait", self._wait, (r, proc.pid)),
        ]
        if w.spec.stdin_payload is not None:
            targets.append((f"hvdrun-rank{r}-stdin", self._feed, (proc, w.spec.stdin_payload)))
        for name, target, args in targets:
            # Daemon threads: a worker's orphaned grandchild may keep a pipe open forever; the
            # join below is bounded and such a thread must not keep hvdrun alive.
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            w.threads.append(t)

    def _pump(self, rank: int, stream: str, pipe: IO[bytes]) -> None:
        self._out.pump(rank, stream, pipe)

    def _wait(self, rank: int, pid: int) -> None:
        self._events.put(("exit", rank, wait_no_reap(pid)))

    @staticmethod
    def _feed(proc: subprocess.Popen[bytes], payload: bytes) -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(payload)
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the worker died first; its exit is reported by the wait thread

    def _stop_all(self, sig: int) -> None:
        for w in self._workers:
            if w.proc is None or w.exit is not None or w.proc.returncode is not None:
                continue
            if sig == signal.SIGTERM and w.proc.stdin is not None:
                try:
                    w.proc.stdin.close()  # the remote wrapper stops its command on EOF
                except OSError:
                    pass
            killpg_quiet(w.proc.pid, sig)

    def _kill_leftovers(self) -> None:
        # Every leader has exited but is not reaped yet, so its pid still names its group:
        # whatever the worker left behind in that group is killed, and nothing else can be.
        for w in self._workers:
            if w.proc is not None and w.proc.returncode is None:
                killpg_quiet(w.proc.pid, signal.SIGKILL)

    def _reap_all(self) -> None:
        for w in self._workers:
            if w.proc is None:
                continue
            if w.proc.stdin is not None:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                killpg_quiet(w.proc.pid, signal.SIGKILL)
                w.proc.wait()

    def _join_threads(self) -> None:
        # Every worker has exited: its pipes reach EOF unless something it left behind in a
        # session of its own still holds them. Such output is copied for 2 s more, then the
        # pumps stop (closing a pipe under a blocked reader used to wait for that process).
        join_all([t for w in self._workers for t in w.threads], 2.0, self._out.stop_pumps)
        for w in self._workers:
            for pipe in (w.proc.stdout, w.proc.stderr) if w.proc is not None else ():
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
