"""Fixtures shared by the unit tests."""
from __future__ import annotations

import logging

import pytest


class LogCapture(logging.Handler):
    """Keeps every record logged to the "horovod" logger (the `horovod_log` fixture)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def text(self):
        return "\n".join(r.getMessage() for r in self.records)

    def lines(self, text):
        """(thread name, message) of the records that contain `text`."""
        return sorted((r.threadName, r.getMessage()) for r in self.records
                      if text in r.getMessage())


@pytest.fixture
def horovod_log():
    cap = LogCapture()
    logger = logging.getLogger("horovod")
    logger.addHandler(cap)
    yield cap
    logger.removeHandler(cap)
