"""Horovod's timeline (`HOROVOD_TIMELINE`) and the tool that reads it.

* `writer`: `Timeline`, the event API the coordinator calls, and its writer thread.
* `tracefile`: the Chrome trace-event file it writes, crash-safe (`FileWriter`).
* `summary`: reads a timeline back (`load_events`) and sums it up (`summarize`,
  `format_summary`, `render_png`).
* `cli`: `python -m collective.timeline summary FILE [--png OUT.png]`.

The names below are importable from `collective.timeline`; the analysis ones load on first use.
"""
from __future__ import annotations

from typing import Any

from .writer import ACTIVITIES, QUEUE_CAPACITY, Timeline

__all__ = ["Timeline", "ACTIVITIES", "QUEUE_CAPACITY", "load_events", "summarize",
           "format_summary", "render_png", "category_of", "Summary", "main"]

_SUMMARY = {"load_events", "summarize", "format_summary", "render_png", "category_of", "Summary"}


def __getattr__(name: str) -> Any:
    if name in _SUMMARY:
        from . import summary
        return getattr(summary, name)
    if name == "main":
        from .cli import main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
