"""ResponseCache (Horovod's): hit/miss/invalid, LRU with eviction inheriting the bit, erase and
renumber consistent on every rank, and the fast-path bit bookkeeping."""
from __future__ import annotations

import random

import pytest

from collective.negotiation import CacheState, ResponseCache
from collective.types import DataType, ReduceOp, Request, RequestType, Response, ResponseType

pytestmark = pytest.mark.timeout(30)


def req(name, **kw):
    kw.setdefault("shape", (4,))
    return Request(rank=0, type=kw.pop("type", RequestType.ALLREDUCE), name=name, **kw)


def resp(name, n=4):
    return Response(type=ResponseType.ALLREDUCE, names=[name], sizes=[n], shapes=[(n,)])


def filled(capacity, names):
    c = ResponseCache(capacity)
    for n in names:
        c.put(resp(n), req(n))
    c.renumber()
    return c


def test_miss_then_hit():
    c = ResponseCache(4)
    assert c.lookup(req("a")) == (CacheState.MISS, -1)
    assert c.put(resp("a"), req("a")) is False
    state, bit = c.lookup(req("a"))
    assert state is CacheState.HIT and bit == 0 and c.name_of(0) == "a"
    assert c.peek(0).names == ["a"] and len(c) == 1 and c.num_bits == 1


@pytest.mark.parametrize("change", [
    dict(shape=(5,)), dict(dtype=DataType.FLOAT64), dict(device=0), dict(prescale=2.0),
    dict(postscale=0.5), dict(reduce_op=ReduceOp.MAX), dict(type=RequestType.ALLGATHER),
    dict(layout=5)])
def test_any_parameter_change_is_invalid(change):
    c = ResponseCache(4)
    c.put(resp("a"), req("a"))
    state, bit = c.lookup(req("a", **change))
    assert state is CacheState.INVALID and bit == 0


def test_put_existing_moves_to_mru():
    c = filled(3, ["a", "b", "c"])
    c.put(resp("a"), req("a"))  # a becomes most recently used
    c.put(resp("d"), req("d"))  # evicts the LRU: b
    assert c.lookup(req("b"))[0] is CacheState.MISS
    assert c.lookup(req("a"))[0] is CacheState.HIT


def test_eviction_inherits_the_bit_and_reports():
    c = filled(2, ["a", "b"])
    bit_a = c.lookup(req("a"))[1]
    assert c.put(resp("c"), req("c")) is True  # evicted a
    assert c.lookup(req("a"))[0] is CacheState.MISS
    assert c.lookup(req("c")) == (CacheState.HIT, bit_a)
    assert c.num_bits == 2 and len(c) == 2


def test_get_updates_lru_peek_does_not():
    c = filled(2, ["a", "b"])
    c.peek(c.lookup(req("a"))[1])
    c.put(resp("c"), req("c"))
    assert c.lookup(req("a"))[0] is CacheState.MISS  # peek did not protect a
    c = filled(2, ["a", "b"])
    c.get(c.lookup(req("a"))[1])
    c.put(resp("c"), req("c"))
    assert c.lookup(req("a"))[0] is CacheState.HIT and c.lookup(req("b"))[0] is CacheState.MISS


def test_erase_leaves_a_hole_and_renumber_compacts_lru_first():
    c = filled(8, ["a", "b", "c", "d"])
    c.get(c.lookup(req("a"))[1])  # LRU order now b, c, d, a
    c.erase(c.lookup(req("c"))[1])
    assert c.num_bits == 4 and len(c) == 3  # a hole
    assert c.lookup(req("c"))[0] is CacheState.MISS
    bit_b = c.lookup(req("b"))[1]
    c.erase(bit_b)
    c.erase(bit_b)  # erasing a hole again is harmless
    c.renumber()
    assert c.num_bits == 2
    assert [c.name_of(i) for i in range(2)] == ["d", "a"]  # LRU gets bit 0
    assert c.name_of(99) is None


def test_clear():
    c = filled(4, ["a", "b"])
    c.clear()
    assert len(c) == 0 and c.num_bits == 0 and c.lookup(req("a"))[0] is CacheState.MISS


def test_identical_operation_sequences_give_identical_bits():
    """Every rank applies the same puts/gets/erases/renumbers in the same order, so every rank
    must end with the same bit numbering (this is what the AND fast path relies on)."""
    rng = random.Random(1234)
    ops = []
    for _ in range(2000):
        k = rng.random()
        name = f"t{rng.randrange(40)}"
        if k < 0.5:
            ops.append(("put", name))
        elif k < 0.75:
            ops.append(("get", name))
        elif k < 0.9:
            ops.append(("erase", name))
        else:
            ops.append(("renumber", None))
    caches = [ResponseCache(16) for _ in range(3)]
    for op, name in ops:
        for c in caches:
            if op == "put":
                c.put(resp(name), req(name))
            elif op == "renumber":
                c.renumber()
            else:
                state, bit = c.lookup(req(name))
                if state is CacheState.HIT:
                    c.get(bit) if op == "get" else c.erase(bit)
    views = [[c.name_of(i) for i in range(c.num_bits)] for c in caches]
    assert views[0] == views[1] == views[2]
    assert len(caches[0]) <= 16


def test_bits_stay_consistent_after_renumber():
    c = filled(4, ["a", "b", "c"])
    for name in ("a", "b", "c"):
        state, bit = c.lookup(req(name))
        assert state is CacheState.HIT and c.name_of(bit) == name and c.peek(bit).names == [name]
