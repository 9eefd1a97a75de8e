"""Gradient buckets (frameworks/torch/_buckets.py): planning, packing order, views, buffers."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks.torch._buckets import Bucket, _flat, _unflat, plan_buckets  # noqa: E402


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
    p = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    g = torch.randn(2, 3, 4, 5)  # contiguous gradient of a channels_last parameter
    assert torch.equal(_flat(g, p), _flat(g.to(memory_format=torch.channels_last), p))
    back = _unflat(_flat(g, p).clone(), p)
    assert torch.equal(back, g) and back.is_contiguous(memory_format=torch.channels_last)


def test_pack_unpack_zeros_for_missing_grads_and_alternating_buffers():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))
    bucket = Bucket([a, b], "bucket.a+1")
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    flat1 = bucket.pack()
    assert flat1.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]  # b has no gradient: zeros
    bucket.unpack(flat1)
    assert a.grad.data_ptr() == flat1.data_ptr() and b.grad.shape == (2, 2)
    flat2 = bucket.pack()  # packs into the other buffer: the grads alias flat1
    assert flat2.data_ptr() != flat1.data_ptr() and torch.equal(flat2, flat1)
    bucket.unpack(flat2)
    views = [a.grad, b.grad]
    assert bucket.pack().data_ptr() == flat1.data_ptr()  # back to the first buffer
    bucket.unpack(flat1)
    bucket.unpack(flat2)
    assert a.grad is views[0] and b.grad is views[1]  # views made once per buffer, reused


def test_mark_ready_completes_once_per_step():
    bucket = Bucket([torch.nn.Parameter(torch.ones(1)) for _ in range(3)], "b")
    assert [bucket.mark_ready() for _ in range(3)] == [False, False, True]
    bucket.reset()
    assert bucket.ready == 0 and bucket.handle is None
