"""The control plane's encoding: round trips, and garbage never decodes (nor runs code)."""
from __future__ import annotations

import os
import pickle
import random
import struct

import pytest

from collective.negotiation import (decode_gathered, decode_requests, decode_responses,
                                    encode_requests, encode_responses)
from collective.types import DataType, ReduceOp, Request, RequestType, Response, ResponseType
from collective.wire import MAX_STR_BYTES, WireError, clip_text, quote_name

REQS = [Request(rank=1, type=RequestType.ALLREDUCE, name="grad.w", dtype=DataType.FLOAT16,
                shape=(3, 4), device=0, root=-1, reduce_op=ReduceOp.AVERAGE, prescale=0.5,
                postscale=2.0, layout=2**64 - 1),
        Request(rank=1, type=RequestType.BROADCAST, name="ünï/ö", dtype=DataType.INT8,
                shape=(), root=3),
        Request(rank=1, type=RequestType.JOIN, name="join.noname")]
RESPS = [Response(type=ResponseType.ALLGATHER, names=["a", "b"], dtype=DataType.INT64,
                  sizes=[1, 2, 3, 4], shapes=[(1, 2), (2, 2)], root=-1, last_joined_rank=2),
         Response(type=ResponseType.ERROR, names=["x"], error="Mismatched ... ✓"),
         Response(type=ResponseType.ALLREDUCE, names=["with\0nul", "", "ü"], sizes=[1, 2, 3],
                  shapes=[(1,), (2, 1), ()])]


def test_round_trip() -> None:
    reqs, shutdown = decode_requests(encode_requests(REQS, True))
    assert reqs == REQS and shutdown is True
    assert all(type(r.type) is RequestType and type(r.dtype) is DataType for r in reqs)
    assert decode_responses(encode_responses(RESPS, False, True)) == (RESPS, False, True, ())
    assert decode_responses(encode_responses(RESPS, False, True, [1, 3])) == (
        RESPS, False, True, (1, 3))
    # the joined ranks travel only with join_active
    assert decode_responses(encode_responses([], True, False, [1])) == ([], True, False, ())
    assert decode_requests(encode_requests([], False)) == ([], False)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ringvod-wire-pwned",))


@pytest.mark.parametrize("decode", [decode_requests, decode_responses])
def test_a_pickle_is_refused(decode) -> None:
    with pytest.raises(WireError, match="malformed"):
        decode(pickle.dumps(([], False)))
    with pytest.raises(WireError):
        decode(pickle.dumps(_Boom()))
    assert not os.path.exists("/tmp/ringvod-wire-pwned")


def test_garbage_raises_wire_error_only() -> None:
    rng = random.Random(16)
    good = [encode_requests(REQS, False), encode_responses(RESPS, True, False),
            encode_requests(REQS, True), encode_responses(RESPS, False, True, [0, 2, 5])]
    for i in range(3000):
        base = bytearray(good[i % 4])
        kind = rng.randrange(4)
        if kind == 0:  # truncate
            data = bytes(base[:rng.randrange(len(base))])
        elif kind == 1:  # flip bytes
            for _ in range(rng.randrange(1, 6)):
                base[rng.randrange(len(base))] = rng.randrange(256)
            data = bytes(base)
        elif kind == 2:  # trailing junk
            data = bytes(base) + os.urandom(rng.randrange(1, 9))
        else:
            data = base[:3] + os.urandom(rng.randrange(0, 200))
        decode = decode_requests if i % 2 == 0 else decode_responses
        try:
            decode(data)
        except WireError:
            pass  # anything else (IndexError, MemoryError, ...) fails the test


def test_huge_counts_do_not_allocate() -> None:
    # a request list claiming 2**32-1 entries in 8 bytes is refused before any work
    with pytest.raises(WireError, match="cannot fit"):
        decode_requests(b"RQ2" + struct.pack("<IB", 0xFFFFFFFF, 0))
    with pytest.raises(WireError, match="cannot fit"):
        decode_responses(b"RS2" + struct.pack("<IBB", 0xFFFFFFFF, 0, 0))
    with pytest.raises(WireError, match="joined ranks cannot fit"):
        decode_responses(b"RS2" + struct.pack("<IBBI", 0, 0, 1, 0xFFFFFFFF))
    with pytest.raises(WireError, match="truncated joined ranks"):
        decode_responses(b"RS2" + struct.pack("<IBB", 0, 0, 1))
    for bad in ((1, 1), (-1,)):
        with pytest.raises(WireError, match="not distinct ranks"):
            decode_responses(b"RS2" + struct.pack("<IBBI", 0, 0, 1, len(bad))
                             + struct.pack(f"<{len(bad)}i", *bad))


def test_the_sender_is_named() -> None:
    with pytest.raises(WireError, match=r"rank 5 sent a malformed request list"):
        decode_gathered([encode_requests(REQS, False), b"\x80\x04junk"], [0, 5])


def test_quote_name_keeps_short_names_and_cuts_long_ones() -> None:
    assert quote_name("grad.w") == "'grad.w'"
    assert quote_name("a" * 200) == repr("a" * 200)
    assert quote_name("a" * 201) == repr("a" * 200) + "... (201 bytes)"
    long = "\u00e9" * (MAX_STR_BYTES // 2)  # 1 MiB in UTF-8
    assert quote_name(long) == repr(long[:200]) + f"... ({MAX_STR_BYTES} bytes)"


@pytest.mark.parametrize("char", ["x", "\u00e9", "\u20ac", "\U0001f600", "\ud800"])
def test_clip_text_bounds_a_text_at_a_character_boundary(char) -> None:
    assert clip_text("short ✓") == "short ✓".encode()
    text = "Mismatched ... " + char * MAX_STR_BYTES
    data = clip_text(text)
    assert len(data) <= MAX_STR_BYTES
    clipped = data.decode("utf-8", "surrogatepass")  # no character split
    size = len(text.encode("utf-8", "surrogatepass"))
    assert clipped.endswith(f" ... (cut from {size} bytes)")
    assert text.startswith(clipped[:-len(f" ... (cut from {size} bytes)")])


def test_an_error_text_over_the_limit_is_sent_clipped() -> None:
    # The last guard: a response's error text past MAX_STR_BYTES travels clipped, instead of the
    # encoder refusing it and ending the job.
    resp = Response(type=ResponseType.ERROR, names=["t"], error="E" * (MAX_STR_BYTES + 10))
    (got,), _, _, _ = decode_responses(encode_responses([resp], False, False))
    assert got.error.startswith("EEE") and got.error.endswith(
        f" ... (cut from {MAX_STR_BYTES + 10} bytes)")
    assert len(got.error.encode()) <= MAX_STR_BYTES
