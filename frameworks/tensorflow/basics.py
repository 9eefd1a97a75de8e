"""`init` and `shutdown` for the TensorFlow API (the other basics come from `collective`)."""
from __future__ import annotations

from typing import Any, Sequence

import collective
from collective import ProcessSet

__all__ = ["init", "shutdown"]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Starts ringvod (idempotent).

    Args:
        comm: None (whole job), a list of world ranks, or an mpi4py communicator.
        process_sets: None, a list of `ProcessSet`, or "dynamic".

    Raises:
        ValueError: invalid process sets.
        EngineUnavailableError: the detected mode needs a package that is not installed.
    """
    collective.init(comm=comm, process_sets=process_sets)


def shutdown() -> None:
    """Stops ringvod on this rank; `init()` may be called again."""
    collective.shutdown()
