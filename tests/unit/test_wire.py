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
from collective.wire import WireError

REQS = [Request(rank=1, type=RequestType.ALLREDUCE, name="grad.w", dtype=DataType.FLOAT16,
                shape=(3, 4), device=0, root=-1, reduce_op=ReduceOp.AVERAGE, prescale=0.5,
                postscale=2.0),
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
    assert decode_responses(encode_responses(RESPS, False, True)) == (RESPS, False, True)
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
    good = [encode_requests(REQS, False), encode_responses(RESPS, True, False)]
    for i in range(3000):
        base = bytearray(good[i % 2])
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
        decode_requests(b"RQ1" + struct.pack("<IB", 0xFFFFFFFF, 0))
    with pytest.raises(WireError, match="cannot fit"):
        decode_responses(b"RS1" + struct.pack("<IBB", 0xFFFFFFFF, 0, 0))


def test_the_sender_is_named() -> None:
    with pytest.raises(WireError, match=r"rank 5 sent a malformed request list"):
        decode_gathered([encode_requests(REQS, False), b"\x80\x04junk"], [0, 5])
