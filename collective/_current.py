"""The current runtime: the `Runtime` that module-level functions act on.

A leaf module (it imports only `errors`), so anything may import it. `init()` sets the
process-wide runtime with `set_current`; tests that run N ranks as N threads of one process
(loopback) give each thread its own with `use_runtime`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator

from .errors import NotInitializedError

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["current", "current_or_none", "process_runtime", "set_current", "use_runtime"]

_lock = threading.Lock()  # guards _process
_process: "Runtime | None" = None


class _ThreadRuntime(threading.local):
    rt: "Runtime | None" = None  # a class default: reading an unset thread-local raises inside


_local = _ThreadRuntime()


def current_or_none() -> "Runtime | None":
    """The runtime of this thread (loopback) or process, None before `init()`."""
    rt = _local.rt
    return rt if rt is not None else _process


def current() -> "Runtime":
    """The runtime of this thread (loopback) or process.

    Raises:
        NotInitializedError: `init()` has not been called (or `shutdown()` was).
    """
    rt = current_or_none()
    if rt is None:
        raise NotInitializedError()
    return rt


def process_runtime() -> "Runtime | None":
    """The process-wide runtime (ignoring a thread's own), None when there is none."""
    return _process


def set_current(rt: "Runtime | None") -> None:
    """Sets the process-wide runtime (`init()`; None at `shutdown()`)."""
    global _process
    with _lock:
        _process = rt


@contextlib.contextmanager
def use_runtime(rt: "Runtime | None") -> Iterator[None]:
    """Makes `rt` this thread's runtime (loopback tests run one rank per thread)."""
    prev = _local.rt
    _local.rt = rt
    try:
        yield
    finally:
        _local.rt = prev
