"""Process-group helpers shared by the launcher and the remote wrapper (Linux/POSIX only)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from typing import Callable

__all__ = ["pdeathsig_preexec", "wait_no_reap", "has_exited", "killpg_quiet",
           "kill_session", "kill_process_tree", "describe_exit", "STOP_SIGNALS",
           "catch_signals"]

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Resolved before any fork: the child only makes one foreign call, no imports or allocation.
_PRCTL = _load_prctl()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def catch_signals(handler: Callable[[int, object], object],
                  signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, object]:
    """Installs `handler` for each of `signals` that is not ignored; returns the handlers it
    replaced (for `signal.signal` to put back). An ignored signal stays ignored: `nohup hvdrun
    ...` ignores SIGHUP, and a job started in the background by a script ignores SIGINT, as
    with horovodrun. Main thread only."""
    old: dict[int, object] = {}
    for sig in signals:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        old[sig] = signal.signal(sig, handler)
    return old


def pdeathsig_preexec() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the launcher dies.

    Without this a SIGKILLed launcher would leave its workers running. It covers the process
    the launcher started, not that process's own children (a worker started as `bash
    train.sh` leaves the script's children running after a SIGKILLed launcher; a launcher
    stopped any other way stops their whole process group).
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def wait_no_reap(pid: int) -> tuple[int, str | None]:
    """Blocks until `pid` exits, without reaping it.

    Returns:
        (shell-style exit code, signal name or None): a death by SIGTERM is (143, "SIGTERM").

    Leaving the zombie in place keeps its pid (and so its process-group id) from being reused
    while the launcher may still signal the group.
    """
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return -1, None
        if info is None:  # pragma: no cover - only with WNOHANG
            continue
        if info.si_code == os.CLD_EXITED:
            return int(info.si_status), None
        return 128 + int(info.si_status), _signal_name(int(info.si_status))


def has_exited(pid: int) -> bool:
    """Whether the child `pid` has exited, without reaping it (so its pid, and the process group
    and session it leads, cannot be reused while the caller still signals them)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid == pid


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killpg_quiet(pgid: int, sig: int) -> bool:
    """Signals a process group; False when no member is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_session(sid: int) -> None:
    """SIGKILLs every process of the session `sid` (Linux: found in /proc), and the process group
    of the same id elsewhere.

    A launcher that starts a child with `start_new_session=True` reaches everything that child
    started this way, including processes in process groups of their own (mpirun puts each of
    its `ssh` clients in one) and ones orphaned when the child died, which a `killpg` misses.
    The caller must not have reaped `sid`'s leader yet, or its id may name another session.
    Found processes are stopped first, so none can fork past the search, then killed.
    """
    _stop_and_kill(sid, lambda: _in_session(sid))


def _in_session(sid: int) -> set[int]:
    """The live processes whose session id is `sid` (from /proc; empty where there is none)."""
    out: set[int] = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state, ppid, pgrp, session.
        if len(fields) > 3 and fields[0] not in (b"Z", b"X") and int(fields[3]) == sid:
            out.add(pid)
    return out


def describe_exit(code: int, signal_name: str | None) -> str:
    """`1`, or `143 (killed by SIGTERM)` for a death by signal."""
    return f"{code} (killed by {signal_name})" if signal_name else str(code)


def kill_process_tree(root: int, marker: str | None = None) -> None:
    """SIGKILLs the process group led by `root` and, where /proc exists (Linux), everything
    else `root` started: its descendants, and every process whose environment holds `marker`
    (a `NAME=value` the caller put in `root`'s environment, which children inherit).

    The group alone misses a child that left it (`setsid`, a new process group); the process
    tree misses one whose parent has exited (a double fork, `setsid -f`: it now belongs to
    init). The marker reaches both, unless the child cleared its environment and was orphaned
    too; nothing short of a cgroup can find that one. Found processes are stopped (SIGSTOP)
    before the next search, so that none can start another behind it, then all are killed.
    """
    needle = marker.encode() if marker else None
    _stop_and_kill(root, lambda: _descendants(root) | _carrying(needle))


def _stop_and_kill(group: int, search: Callable[[], set[int]]) -> None:
    """SIGSTOPs process group `group` and every process `search()` finds, searching again
    until a pass finds nothing new (each pass stops what it finds, so forks cannot outrun it
    for long), then SIGKILLs the group and all found."""
    killpg_quiet(group, signal.SIGSTOP)
    found: set[int] = set()
    me = os.getpid()
    for _ in range(20):
        new = search() - found - {me}
        if not new:
            break
        for pid in new:
            _kill_quiet(pid, signal.SIGSTOP)
        found |= new
    killpg_quiet(group, signal.SIGKILL)
    for pid in found:
        _kill_quiet(pid, signal.SIGKILL)


def _kill_quiet(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (not Linux)
        return []


def _descendants(root: int) -> set[int]:
    """The live descendants of `root` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def _carrying(needle: bytes | None) -> set[int]:
    """The processes whose environment holds `needle` as one whole entry (from /proc)."""
    if not needle:
        return set()
    out: set[int] = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.add(pid)
        except OSError:  # gone, or another user's
            continue
    return out
