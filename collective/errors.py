"""The one place where ringvod's exceptions are defined.

Categories:

| exception | raised when | recoverable (elastic) |
|---|---|---|
| `NotInitializedError` (ValueError) | an op or query is called before `init()` | no |
| `DuplicateNameError` (ValueError) | a name is submitted while the same name is still pending | no |
| `HorovodInternalError` (RuntimeError) | a collective failed (mismatch across ranks, engine error, dead peer) | yes: restore and retry |
| `MismatchError` | ranks disagree on a tensor's dtype/shape/op/root/scale factors | no: a bug of the script, which every world meets again; `elastic.run` raises it |
| `ShutdownError` | the runtime was shut down (here or on another rank) | yes |
| `CollectiveTimeoutError` | a peer did not answer within the configured timeout | yes |
| `StallError` (a `ShutdownError`) | a stall check shut the job down (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`) | yes |
| `EngineUnavailableError` (ImportError) | an engine's backend package is not installed | no |
| `HostsUpdatedInterrupt` (RuntimeError) | elastic membership changed; reset without restore | special |
"""
from __future__ import annotations

__all__ = [
    "CollectiveError",
    "NotInitializedError",
    "DuplicateNameError",
    "HorovodInternalError",
    "MismatchError",
    "ShutdownError",
    "CollectiveTimeoutError",
    "StallError",
    "EngineUnavailableError",
    "HostsUpdatedInterrupt",
    "NOT_INITIALIZED_MESSAGE",
    "SHUT_DOWN_MESSAGE",
]

NOT_INITIALIZED_MESSAGE = "Horovod has not been initialized; use hvd.init()."

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message."
)


class CollectiveError(Exception):
    """Base class of every exception ringvod defines."""


class NotInitializedError(CollectiveError, ValueError):
    """Raised when ringvod is used before `init()` (Horovod raises ValueError here)."""

    def __init__(self, message: str = NOT_INITIALIZED_MESSAGE) -> None:
        super().__init__(message)


class DuplicateNameError(CollectiveError, ValueError):
    """Raised at enqueue when a tensor name is already pending on this rank."""


class HorovodInternalError(CollectiveError, RuntimeError):
    """Raised when a collective fails; elastic training restores the last commit and retries."""


class MismatchError(HorovodInternalError):
    """Raised on every rank when ranks disagree about a tensor (dtype, shape, op, root, ...)."""


class ShutdownError(HorovodInternalError):
    """Raised for pending and new ops after the runtime shut down on this or another rank."""

    def __init__(self, message: str = SHUT_DOWN_MESSAGE) -> None:
        super().__init__(message)


class CollectiveTimeoutError(HorovodInternalError, TimeoutError):
    """Raised when a peer does not answer within the configured timeout (dead or hung peer)."""


class StallError(ShutdownError):
    """Raised for pending and new ops on every rank once a stall check shut the job down
    (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); a `ShutdownError`."""


class EngineUnavailableError(CollectiveError, ImportError):
    """Raised when an engine or control plane needs a package that is not installed."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in elastic jobs when hosts were added or removed; reset without restoring state.

    Attributes:
        skip_sync: True when only removals happened, so the surviving state needs no broadcast.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync
