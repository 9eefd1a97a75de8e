"""Limits and the error of the control plane's plain-data encoding (stdlib only).

Nothing that arrives from another process is ever unpickled by the control plane: negotiation's
request and response lists are fixed-layout little-endian fields (`collective.negotiation`),
and the topology exchange, process-set changes and the NCCL setup exchange are checked JSON or
UTF-8. Decoding checks every length against the bytes actually present before it reads or
allocates anything; garbage raises `WireError` (a `ValueError`) naming what was wrong. It cannot
run code, nor make the decoder allocate more than the message's own size.
"""
from __future__ import annotations

__all__ = ["WireError", "MAX_STR_BYTES", "MAX_DIMS", "NAME_CHARS_IN_TEXT", "quote_name",
           "clip_text"]

MAX_STR_BYTES = 1 << 20  # names, error texts, host names, JSON messages
MAX_DIMS = 64  # tensor rank
NAME_CHARS_IN_TEXT = 200  # of a tensor name quoted in an error text


def quote_name(name: str) -> str:
    """`name` as an error text quotes it (`repr`), names past NAME_CHARS_IN_TEXT characters cut
    to their start and their length: a text naming tensors stays far below MAX_STR_BYTES even
    when the names themselves come close to it."""
    if len(name) <= NAME_CHARS_IN_TEXT:
        return repr(name)
    n = len(name.encode("utf-8", "surrogatepass"))
    return f"{name[:NAME_CHARS_IN_TEXT]!r}... ({n} bytes)"


def clip_text(text: str) -> bytes:
    """`text` in UTF-8, cut at a character boundary to at most MAX_STR_BYTES bytes, with a note
    of the cut (the last guard on an error text before it is sent)."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= MAX_STR_BYTES:
        return data
    note = f" ... (cut from {len(data)} bytes)".encode()
    end = MAX_STR_BYTES - len(note)
    while data[end] & 0xC0 == 0x80:  # a continuation byte: the cut would split a character
        end -= 1
    return data[:end] + note


class WireError(ValueError):
    """A control-plane message is malformed (truncated, out of bounds or of the wrong kind)."""
