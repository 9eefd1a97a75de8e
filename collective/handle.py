"""`Handle`: the Future-like completion object every async op returns.

Only the runtime completes a handle (`_set_result` / `_set_exception`); users `wait()`,
`poll()` via `done()`, or read `result()`. A handle keeps the op's tensors referenced until it
completes, so that a caller dropping its reference cannot free memory the engine still uses.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

__all__ = ["Handle", "GroupHandle"]

_log = logging.getLogger("horovod")

PENDING, FINISHED = "PENDING", "FINISHED"
_allocate_lock = threading.Lock
# Guards every handle's state/callback transition; held for a few instructions only.
_STATE_LOCK = threading.Lock()


class Handle:
    """Completion of one op (or of one grouped op)."""

    __slots__ = ("name", "_latch", "_state", "_result", "_exception", "_callbacks", "keepalive",
                 "__weakref__")

    def __init__(self, name: str, keepalive: Any = None) -> None:
        self.name = name
        # A held lock is the completion latch: waiters acquire-and-release it, completion
        # releases it. Cheaper to create than a Condition (one per op on the hot path).
        self._latch = _allocate_lock()
        self._latch.acquire()
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] | None = None
        self.keepalive = keepalive  # tensors that must outlive the op (guarded by completion)

    def __repr__(self) -> str:
        return f"<Handle {self.name} {self._state}>"

    def done(self) -> bool:
        """True once the op finished (successfully or not). Never blocks."""
        return self._state == FINISHED

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the op finishes and returns its result.

        Raises:
            TimeoutError: the op did not finish within `timeout` seconds.
            HorovodInternalError: the op failed on this or another rank.
        """
        if self._state != FINISHED:
            if not self._latch.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
                raise TimeoutError(f"op {self.name} did not finish within {timeout} s")
            self._latch.release()  # let the next waiter through
        if self._exception is not None:
            raise self._exception
        return self._result

    result = wait

    def exception(self) -> BaseException | None:
        """The op's exception once it finished, else None (does not block)."""
        return self._exception

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Calls `fn(handle)` when the op finishes (at once if it already has)."""
        with _STATE_LOCK:
            if self._state != FINISHED:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    # -- runtime side ------------------------------------------------------------------------
    def _set_result(self, result: Any) -> None:
        """Completes the handle. Only the runtime and unit tests call this."""
        self._finish(result, None)

    def _set_exception(self, exc: BaseException) -> None:
        """Fails the handle. Only the runtime and unit tests call this."""
        self._finish(None, exc)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        with _STATE_LOCK:
            if self._state == FINISHED:
                return
            self._result, self._exception = result, exc
            self._state = FINISHED
            self.keepalive = None
            callbacks, self._callbacks = self._callbacks, None
        self._latch.release()
        if callbacks:
            for fn in callbacks:
                self._run_callback(fn)

    def _run_callback(self, fn: Callable[["Handle"], None]) -> None:
        try:
            fn(self)
        except Exception:  # a user callback must not kill the coordinator
            _log.exception("exception in callback of %s", self.name)


class GroupHandle(Handle):
    """Completes when all member handles complete; result is the list of member results."""

    __slots__ = ("_members", "_remaining", "_lock")

    def __init__(self, name: str, members: list[Handle]) -> None:
        super().__init__(name)
        self._members = members
        self._remaining = len(members)
        self._lock = threading.Lock()
        if not members:
            self._set_result([])
        for m in members:
            m.add_done_callback(self._member_done)

    def _member_done(self, _: Handle) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            exc = next((m.exception() for m in self._members if m.exception() is not None), None)
            if exc is not None:
                self._set_exception(exc)
            else:
                self._set_result([m._result for m in self._members])
