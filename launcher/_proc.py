"""Process-group helpers shared by the launcher and the remote wrapper (Linux/POSIX only)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from typing import Callable

__all__ = ["pdeathsig_preexec", "wait_no_reap", "killpg_quiet", "describe_exit"]

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


def pdeathsig_preexec() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the launcher dies.

    Without this a SIGKILLed launcher would leave its workers running (no orphans, even then).
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


def describe_exit(code: int, signal_name: str | None) -> str:
    """`1`, or `143 (killed by SIGTERM)` for a death by signal."""
    return f"{code} (killed by {signal_name})" if signal_name else str(code)
