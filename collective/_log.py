"""Rank-aware logging in Horovod's line format.

A line looks like Horovod's, prefixed with the rank (and the host in multi-host jobs)::

    [1][2024-05-01 12:00:00.123456: W stall.py:88] One or more tensors were submitted ...
    [node2:5][W stall.py:88] ...                       (HOROVOD_LOG_HIDE_TIME=1, multi-host)

The level letter is one of `TDIWEF` (trace, debug, info, warning, error, fatal). The level and
the hide-time switch come from `HOROVOD_LOG_LEVEL` / `HOROVOD_LOG_HIDE_TIME`, read by
`collective.config` (the only reader of the environment) and passed to `configure()` at init.
Lines go to the *current* `sys.stderr` (looked up per line, so redirection after import works).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from .stall_report import SHUTDOWN_LESS_THAN_WARNING, format_stall_report

__all__ = ["get_logger", "configure", "parse_level", "log_once", "trace", "TRACE", "LEVELS",
           "format_stall_report", "SHUTDOWN_LESS_THAN_WARNING"]

TRACE = 5
LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO,
          "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
_LETTERS = {TRACE: "T", logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W",
            logging.ERROR: "E", logging.CRITICAL: "F"}
logging.addLevelName(TRACE, "TRACE")

_LOGGER = logging.getLogger("horovod")
_LOGGER.setLevel(logging.WARNING)


def _letter(levelno: int) -> str:
    letter = _LETTERS.get(levelno)
    if letter is None:  # custom levels: the nearest standard one below
        below = [lvl for lvl in _LETTERS if lvl <= levelno]
        letter = _LETTERS[max(below)] if below else "T"
    return letter


class _Formatter(logging.Formatter):
    """`[rank][YYYY-mm-dd HH:MM:SS.uuuuuu: L file:line] msg` (Horovod's logging.cc)."""

    def __init__(self, rank: int | None, host: str | None, hide_time: bool) -> None:
        super().__init__()
        self.hide_time = hide_time
        if rank is None:
            self.who = ""
        else:
            self.who = f"[{host}:{rank}]" if host else f"[{rank}]"

    def format(self, record: logging.LogRecord) -> str:
        where = f"{record.filename}:{record.lineno}"
        if self.hide_time:
            head = f"[{_letter(record.levelno)} {where}]"
        else:
            secs = int(record.created)
            us = int(round((record.created - secs) * 1e6))
            if us >= 1_000_000:
                secs, us = secs + 1, us - 1_000_000
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(secs))
            head = f"[{stamp}.{us:06d}: {_letter(record.levelno)} {where}]"
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"{self.who}{head} {msg}"


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler bound to whatever `sys.stderr` is when a line is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


_handler: logging.Handler | None = None
_once_lock = threading.Lock()
_once_keys: set[str] = set()


def parse_level(level: str) -> int:
    """Maps 'trace'…'fatal' (any case; Horovod also accepts 'warn') to a logging level.

    Raises:
        ValueError: the name is not a Horovod log level.
    """
    key = level.strip().lower()
    key = {"warn": "warning", "critical": "fatal"}.get(key, key)
    if key not in LEVELS:
        raise ValueError(f"HOROVOD_LOG_LEVEL={level!r} is not a log level; use one of "
                         f"{', '.join(LEVELS)}")
    return LEVELS[key]


def configure(level: str = "warning", hide_time: bool = False, rank: int | None = None,
              host: str | None = None) -> None:
    """Sets up the `horovod` logger; called at every init (idempotent, updates the prefix).

    Args:
        level: HOROVOD_LOG_LEVEL; an unknown name logs a warning and means 'warning'.
        hide_time: HOROVOD_LOG_HIDE_TIME.
        rank: global rank for the line prefix (None = no prefix).
        host: host name for the prefix; pass it only in multi-host jobs.
    """
    global _handler
    try:
        lvl, bad = parse_level(level or "warning"), None
    except ValueError as exc:
        lvl, bad = logging.WARNING, exc
    if _handler is None:
        _handler = _StderrHandler()
        _LOGGER.addHandler(_handler)
        _LOGGER.propagate = False
    _handler.setFormatter(_Formatter(rank, host, hide_time))
    _LOGGER.setLevel(lvl)
    if bad is not None:  # once per value: init() configures before and after forming the world
        log_once(f"bad log level {level!r}", logging.WARNING, "%s; using 'warning'", bad)


def get_logger() -> logging.Logger:
    """The `horovod` logger (lines appear once `configure()` has run, or via logging's
    last-resort handler for warnings and above before that)."""
    return _LOGGER


def trace(msg: str, *args: Any) -> None:
    """Logs at TRACE (below DEBUG), the level of Horovod's per-cycle messages."""
    if _LOGGER.isEnabledFor(TRACE):
        _LOGGER.log(TRACE, msg, *args, stacklevel=2)  # stacklevel: report the caller's line


def log_once(key: str, level: int, msg: str, *args: Any) -> bool:
    """Logs `msg` the first time `key` is seen in this process (e.g. the cache-eviction
    warning); returns whether it logged."""
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    _LOGGER.log(level, msg, *args, stacklevel=2)
    return True
