"""Cross-memory attach: read a peer process's memory with one kernel copy (Linux
`process_vm_readv`, through ctypes; what Open MPI's `smsc/cma` does).

A same-host link uses it, when both ends can, so that a receiver copies (or reduces) straight
out of the sender's buffer: no staging copy through a shared ring. The kernel allows it
between processes of one user unless a policy forbids it (Yama `ptrace_scope` >= 2, or a
seccomp profile without `process_vm_readv`); `probe` finds out at link set-up. The pid read
from is the one the kernel reports at the other end of the Unix socket (SO_PEERCRED), never
one a peer merely announced (`shm.make_link`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["available", "read", "probe"]


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load()


def available() -> bool:
    return _READV is not None


def read(pid: int, local: int, remote: int, n: int) -> None:
    """Copies `n` bytes at address `remote` of process `pid` to address `local` here.

    Raises:
        OSError: the peer is gone (ESRCH), the range is not mapped there (EFAULT), or the
            kernel refuses (EPERM).
    """
    lo, ro = _IOVec(), _IOVec()
    done = 0
    while done < n:
        lo.iov_base, lo.iov_len = local + done, n - done
        ro.iov_base, ro.iov_len = remote + done, n - done
        r = _READV(pid, ctypes.byref(lo), 1, ctypes.byref(ro), 1, 0)
        if r <= 0:
            err = ctypes.get_errno() if r < 0 else 0
            raise OSError(err or 5, f"process_vm_readv from pid {pid}: "
                                    f"{os.strerror(err) if err else 'short read'}")
        done += r


def probe(pid: int, remote: int, expect: bytes) -> bool:
    """True when `expect` can be read at `remote` in process `pid`."""
    if _READV is None:
        return False
    buf = ctypes.create_string_buffer(len(expect))
    try:
        read(pid, ctypes.addressof(buf), remote, len(expect))
    except OSError:
        return False
    return buf.raw == expect
