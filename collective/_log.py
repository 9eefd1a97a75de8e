"""Rank-aware logging: Horovod's line format, level from HOROVOD_LOG_LEVEL (via config)."""
from __future__ import annotations

import logging
import sys
import time

__all__ = ["get_logger", "configure"]

_LEVELS = {"trace": 5, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "fatal": logging.CRITICAL}
_LETTERS = {5: "T", logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W",
            logging.ERROR: "E", logging.CRITICAL: "F"}
logging.addLevelName(5, "TRACE")

_LOGGER = logging.getLogger("horovod")


class _Formatter(logging.Formatter):
    def __init__(self, rank: int | None, host: str | None, hide_time: bool) -> None:
        super().__init__()
        self.rank, self.host, self.hide_time = rank, host, hide_time

    def format(self, record: logging.LogRecord) -> str:
        letter = _LETTERS.get(record.levelno, "I")
        where = f"{record.filename}:{record.lineno}"
        if self.hide_time:
            head = f"[{letter} {where}]"
        else:
            t = time.localtime(record.created)
            us = int((record.created % 1) * 1e6)
            head = f"[{time.strftime('%Y-%m-%d %H:%M:%S', t)}.{us:06d}: {letter} {where}]"
        who = ""
        if self.rank is not None:
            who = f"[{self.host}:{self.rank}]" if self.host else f"[{self.rank}]"
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"{who}{head} {msg}"


_handler: logging.Handler | None = None


def configure(level: str = "warning", hide_time: bool = False, rank: int | None = None,
              host: str | None = None) -> None:
    """Sets up the `horovod` logger once per init (idempotent)."""
    global _handler
    lvl = _LEVELS.get(level.strip().lower(), logging.WARNING)
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _LOGGER.addHandler(_handler)
        _LOGGER.propagate = False
    _handler.setFormatter(_Formatter(rank, host, hide_time))
    _LOGGER.setLevel(lvl)


def get_logger() -> logging.Logger:
    return _LOGGER
