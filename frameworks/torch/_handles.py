"""Int handles for the torch API: Horovod's async functions return ints, so each int maps to the
runtime's `Handle`, a function that turns its result into torch tensors, and the tensors that
must stay alive until the op completes (the engine reads and writes their memory).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

from collective import Handle

__all__ = ["HandleMap", "handles"]


class HandleMap:
    """Thread-safe int -> pending op table. `init()` clears it (as Horovod's does).

    Each operation is one dict operation (atomic) and ids come from `itertools.count` (whose
    `next` is atomic), so no lock is needed; entries are (handle, finish, keepalive)."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[Handle, Callable[[Any], Any], tuple]] = {}
        self._ids = itertools.count(1)

    def add(self, handle: Handle, finish: Callable[[Any], Any], *keepalive: Any) -> int:
        """Registers an op; returns its int handle."""
        hid = next(self._ids)
        self._pending[hid] = (handle, finish, keepalive)
        return hid

    def _get(self, hid: int) -> tuple[Handle, Callable[[Any], Any], tuple]:
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
        return self._get(hid)[0].done()

    def synchronize(self, hid: int) -> Any:
        """Waits for the op, forgets the handle and returns the torch-level result.

        Raises:
            ValueError: unknown handle.
            HorovodInternalError: the op failed on this or another rank.
        """
        handle, finish, _keep = self._get(hid)
        try:
            result = handle.wait()
        finally:
            self._pending.pop(hid, None)
        return finish(result)

    def clear(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)


handles = HandleMap()
