"""Gradient buckets (frameworks/torch/_buckets.py): planning, packing order, views, buffers."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks.torch._buckets import Bucket, _unflat, layout_digest, plan_buckets  # noqa: E402


def test_plan_is_reverse_order_small_first_bucket_and_split_by_dtype():
    ps = [torch.zeros(256 * 1024) for _ in range(4)]  # 1 MiB each (float32)
    ps.append(torch.zeros(10, dtype=torch.float64))
    names = [f"p{i}" for i in range(5)]
    plan = plan_buckets(ps, names, cap_bytes=3 * 1024 * 1024, first_bytes=1024 * 1024)
    # Reverse order; the first bucket (here the float64 one) is capped at first_bytes, later
    # ones at cap_bytes; a dtype change always starts a new bucket.
    assert [idx for idx, _ in plan] == [[4], [3, 2, 1], [0]]
    assert [n for _, n in plan] == ["bucket.p4+0", "bucket.p3+2", "bucket.p0+0"]
    plan = plan_buckets(ps[:4], names[:4], cap_bytes=3 * 1024 * 1024, first_bytes=1024 * 1024)
    assert [idx for idx, _ in plan] == [[3], [2, 1, 0]]


def test_pack_order_follows_the_parameter_layout_not_the_gradient():
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    g = torch.randn(2, 3, 4, 5)  # contiguous gradient of a channels_last parameter
    bucket = Bucket([p], "b")
    p.grad = g.clone()
    flat_a = bucket.pack().clone()
    p.grad = g.to(memory_format=torch.channels_last)
    assert torch.equal(bucket.pack(), flat_a)  # same bytes whatever the gradient's layout
    # the parameter's memory order (channels_last: N, H, W, C)
    assert torch.equal(flat_a, g.permute(0, 2, 3, 1).reshape(-1))
    assert torch.equal(_unflat(flat_a, p), g)
    grad = p.grad
    bucket.unpack(flat_a * 2)
    assert p.grad is grad and torch.equal(p.grad, g * 2)  # written back in place


def test_pack_unpack_zeros_for_missing_grads_and_in_place_write_back():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))
    bucket = Bucket([a, b], "bucket.a+1")
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    flat = bucket.pack()
    assert flat.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]  # b has no gradient: zeros
    ga = a.grad
    flat.mul_(2)
    bucket.unpack(flat)
    assert a.grad is ga and a.grad.tolist() == [2.0, 4.0, 6.0]  # same tensor, new values
    assert b.grad.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # a copy: no gradient shares the buffer's storage
    assert b.grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert a.grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    flat2 = bucket.pack()
    assert flat2.data_ptr() == flat.data_ptr()  # one buffer, reused every step
    assert flat2.tolist() == [2.0, 4.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    bucket.unpack(flat2.to(torch.float16))  # a decompressed copy is written back too
    assert a.grad is ga and a.grad.tolist() == [2.0, 4.0, 6.0]


def test_create_graph_gradients_are_rejected_at_pack():
    a = torch.nn.Parameter(torch.ones(2))
    bucket = Bucket([a], "b")
    a.grad = torch.ones(2, requires_grad=True)
    with pytest.raises(AssertionError, match="create_graph"):
        bucket.pack()


def test_mark_ready_completes_once_per_step():
    bucket = Bucket([torch.nn.Parameter(torch.ones(1)) for _ in range(3)], "b")
    assert [bucket.mark_ready() for _ in range(3)] == [False, False, True]
    bucket.reset()
    assert bucket.ready == 0 and bucket.handle is None


def test_layout_digest_tells_shapes_and_memory_layouts_apart():
    def p(*shape, cl=False):
        t = torch.zeros(shape)
        return torch.nn.Parameter(t.to(memory_format=torch.channels_last) if cl else t)

    d = layout_digest([p(2, 3), p(4)])
    assert d == layout_digest([p(2, 3), p(4)]) and 0 < d < 2**64
    others = [layout_digest([p(3, 2), p(4)]), layout_digest([p(4), p(2, 3)]),
              layout_digest([p(6), p(4)]), layout_digest([p(2, 3)])]
    assert d not in others and len(set(others)) == len(others)
    assert layout_digest([p(1, 2, 3, 4)]) != layout_digest([p(1, 2, 3, 4, cl=True)])
    bucket = Bucket([p(2, 3), p(4)], "b", member_names=["w", "b"])
    assert bucket.layout == d and bucket.describe() == "'w' (2, 3), 'b' (4,)"
    assert Bucket([p(1)] * 3, "c").describe(limit=2) == "'0' (1,), '1' (1,) and 1 more"
