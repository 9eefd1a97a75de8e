"""Faults that tests inject into the library's start-up."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import pytest


@contextlib.contextmanager
def coordinator_thread_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """While active, starting the coordinator's thread (`hvd-coordinator`) raises as when the
    system has no thread left; other threads start as usual."""
    original_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "hvd-coordinator":
            raise RuntimeError("can't start new thread")
        original_start(self)

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        yield
