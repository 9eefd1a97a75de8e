"""Bounds-checked binary encoding of control-plane messages (stdlib only).

Nothing that arrives from another process is ever unpickled by the control plane: requests,
responses and the topology exchange are encoded here as fixed-layout little-endian fields
(`struct`), and decoding checks every length against the bytes actually present before it
reads or allocates anything. Garbage raises `WireError` (a `ValueError`) naming what was
wrong; it cannot run code or make the decoder allocate more than the message's own size.
"""
from __future__ import annotations

import struct
from typing import Sequence

__all__ = ["WireError", "Writer", "Reader", "MAX_STR_BYTES", "MAX_DIMS"]

MAX_STR_BYTES = 1 << 20  # names, error texts, host names
MAX_DIMS = 64  # tensor rank

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


class WireError(ValueError):
    """A control-plane message is malformed (truncated, out of bounds or of the wrong kind)."""


class Writer:
    """Appends fields to a bytearray; `bytes()` gives the message."""

    __slots__ = ("buf",)

    def __init__(self, magic: bytes = b"") -> None:
        self.buf = bytearray(magic)

    def pack(self, st: struct.Struct, *values: object) -> None:
        self.buf += st.pack(*values)

    def u8(self, v: int) -> None:
        self.buf += _U8.pack(v)

    def u32(self, v: int) -> None:
        self.buf += _U32.pack(v)

    def i64(self, v: int) -> None:
        self.buf += _I64.pack(v)

    def str(self, s: str) -> None:
        b = s.encode("utf-8", "surrogatepass")
        if len(b) > MAX_STR_BYTES:
            raise WireError(f"string of {len(b)} bytes exceeds the {MAX_STR_BYTES}-byte limit "
                            f"of control-plane messages ({s[:40]!r}...)")
        self.buf += _U32.pack(len(b))
        self.buf += b

    def ints(self, values: Sequence[int]) -> None:
        n = len(values)
        self.buf += _U32.pack(n)
        if n:
            self.buf += struct.pack(f"<{n}q", *values)

    def __bytes__(self) -> bytes:
        return bytes(self.buf)


class Reader:
    """Reads fields back, checking every length against what is left."""

    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes, what: str, magic: bytes = b"") -> None:
        self.data = bytes(data) if not isinstance(data, bytes) else data
        self.what = what
        self.pos = 0
        if magic:
            if self.data[:len(magic)] != magic:
                raise WireError(f"malformed {what}: it does not start with {magic!r} (got "
                                f"{self.data[:len(magic)]!r}); a peer speaks another protocol "
                                "or version")
            self.pos = len(magic)

    def _need(self, n: int) -> int:
        p = self.pos
        if n < 0 or p + n > len(self.data):
            raise WireError(f"malformed {self.what}: needs {n} more bytes at offset {p}, "
                            f"{len(self.data) - p} left (truncated or corrupt)")
        self.pos = p + n
        return p

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack_from(self.data, self._need(st.size))

    def u8(self) -> int:
        return self.data[self._need(1)]

    def u32(self) -> int:
        return _U32.unpack_from(self.data, self._need(4))[0]

    def i64(self) -> int:
        return _I64.unpack_from(self.data, self._need(8))[0]

    def count(self, min_item_bytes: int, limit: int | None = None) -> int:
        """A u32 element count, refused when the items could not fit in what is left."""
        n = self.u32()
        if limit is not None and n > limit:
            raise WireError(f"malformed {self.what}: count {n} exceeds the limit {limit}")
        if n * min_item_bytes > len(self.data) - self.pos:
            raise WireError(f"malformed {self.what}: count {n} does not fit in the "
                            f"{len(self.data) - self.pos} bytes left")
        return n

    def str(self) -> str:
        n = self.count(1, MAX_STR_BYTES)
        p = self._need(n)
        try:
            return self.data[p:p + n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise WireError(f"malformed {self.what}: a string is not UTF-8 ({exc})") from None

    def ints(self, limit: int | None = None) -> list[int]:
        n = self.count(8, limit)
        p = self._need(8 * n)
        return list(struct.unpack_from(f"<{n}q", self.data, p)) if n else []

    def ints_n(self, n: int) -> list[int]:
        """`n` i64 values (the count came in a fixed header)."""
        p = self._need(8 * n)
        return list(struct.unpack_from(f"<{n}q", self.data, p)) if n else []

    def done(self) -> None:
        if self.pos != len(self.data):
            raise WireError(f"malformed {self.what}: {len(self.data) - self.pos} unexpected "
                            "bytes after the end")
