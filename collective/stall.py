"""Stall inspector: names that some ranks submitted and others have not, for too long.

Runs on rank 0 of each process set over the message table (`MessageTable.pending()`): once per
warning period, and also at the moment a pending name reaches the warning (or shutdown) time,
so the first warning comes at the setting, not up to twice it. Pure apart from the clock,
which callers may inject for tests.
"""
from __future__ import annotations

import time
from typing import Callable

from .stall_report import SHUTDOWN_LESS_THAN_WARNING, format_stall_report

__all__ = ["StallInspector"]


class StallInspector:
    def __init__(self, warning_time: float, shutdown_time: float, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, warn=None) -> None:
        self.enabled = enabled and warning_time > 0
        self.warning_time = warning_time
        self.shutdown_time = shutdown_time
        if shutdown_time > 0 and shutdown_time < warning_time:
            if warn is not None:
                warn(SHUTDOWN_LESS_THAN_WARNING)
            self.shutdown_time = 0.0
        self._clock = clock
        self._next = clock() + warning_time  # when `due` is next true
        self.shutdown_ranks: set[int] = set()  # global ranks the last check shuts down for

    def due(self) -> bool:
        return self.enabled and self._clock() >= self._next

    def check(self, pending: dict[str, tuple[set[int], float]], size: int,
              global_ranks: list[int], joined: set[int]) -> tuple[str | None, bool]:
        """Returns (report or None, shutdown?) for names older than the warning time."""
        now = self._clock()
        warn, stop = self.warning_time, self.shutdown_time
        # Next check: a period from now (reports repeat each period, as Horovod's do), or
        # earlier when a pending name reaches the warning or the shutdown time.
        nxt = now + warn
        for _, first_seen in pending.values():
            age = now - first_seen
            if age < warn:
                nxt = min(nxt, first_seen + warn)
            elif stop > 0 and age < stop:
                nxt = min(nxt, first_seen + stop)
        self._next = nxt
        missing: dict[int, list[str]] = {}
        shutdown_ranks: set[int] = set()
        for name, (ready, first_seen) in pending.items():
            age = now - first_seen
            if age < self.warning_time:
                continue
            for r in range(size):
                if r in ready or r in joined:
                    continue
                g = global_ranks[r]
                missing.setdefault(g, []).append(name)
                if self.shutdown_time > 0 and age >= self.shutdown_time:
                    shutdown_ranks.add(g)
        self.shutdown_ranks = shutdown_ranks
        if not missing:
            return None, False
        report = format_stall_report(missing, shutdown_ranks, self.warning_time,
                                     self.shutdown_time)
        return report, bool(shutdown_ranks)
