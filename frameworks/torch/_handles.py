"""Int handles for the torch API: Horovod's async functions return ints, so each int maps to the
runtime's `Handle`, a function that turns its result into torch tensors, and the tensors that
must stay alive until the op completes (the engine reads and writes their memory).
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from collective import Handle

__all__ = ["HandleMap", "handles"]


@dataclass(slots=True)
class _Pending:
    handle: Handle
    finish: Callable[[Any], Any]
    keepalive: tuple


class HandleMap:
    """Thread-safe int -> pending op table. `init()` clears it (as Horovod's does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _pending
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    def add(self, handle: Handle, finish: Callable[[Any], Any], *keepalive: Any) -> int:
        """Registers an op; returns its int handle."""
        hid = next(self._ids)
        with self._lock:
            self._pending[hid] = _Pending(handle, finish, keepalive)
        return hid

    def _get(self, hid: int) -> _Pending:
        with self._lock:
            p = self._pending.get(hid)
        if p is None:
            raise ValueError(f"unknown handle {hid!r}: it was already synchronized, or it comes "
                             "from before the last hvd.init(). Synchronize each handle once.")
        return p

    def poll(self, hid: int) -> bool:
        """True when the op finished. Never blocks.

        Raises:
            ValueError: unknown handle.
        """
        return self._get(hid).handle.done()

    def synchronize(self, hid: int) -> Any:
        """Waits for the op, forgets the handle and returns the torch-level result.

        Raises:
            ValueError: unknown handle.
            HorovodInternalError: the op failed on this or another rank.
        """
        p = self._get(hid)
        try:
            result = p.handle.wait()
        finally:
            with self._lock:
                self._pending.pop(hid, None)
        return p.finish(result)

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)


handles = HandleMap()
