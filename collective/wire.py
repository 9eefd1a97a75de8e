"""Limits and the error of the control plane's plain-data encoding (stdlib only).

Nothing that arrives from another process is ever unpickled by the control plane: negotiation's
request and response lists are fixed-layout little-endian fields (`collective.negotiation`),
and the topology exchange, process-set changes and the NCCL setup exchange are checked JSON or
UTF-8. Decoding checks every length against the bytes actually present before it reads or
allocates anything; garbage raises `WireError` (a `ValueError`) naming what was wrong. It cannot
run code, nor make the decoder allocate more than the message's own size.
"""
from __future__ import annotations

__all__ = ["WireError", "MAX_STR_BYTES", "MAX_DIMS"]

MAX_STR_BYTES = 1 << 20  # names, error texts, host names, JSON messages
MAX_DIMS = 64  # tensor rank


class WireError(ValueError):
    """A control-plane message is malformed (truncated, out of bounds or of the wrong kind)."""
