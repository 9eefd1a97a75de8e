"""Gradient buckets for `DistributedOptimizer`: one allreduce per ~25 MB of gradients.

Why: a Python hook per parameter that enqueues its own allreduce costs the autograd thread
an event record, a request, a handle and a coordinator wake-up per gradient, which delays
backward's kernel launches: ResNet-50's 161 hooks made backward's host time several times
DDP's (`benchmarks/gpu_resnet.py --phases` against `ddp_resnet.py --phases`). With buckets a
hook only counts; when the last gradient of a bucket is final, one batched copy
(`torch.cat(out=)`) packs the bucket into a persistent flat buffer and one allreduce is
enqueued, as DDP's reducer does.

Parameters are assigned in reverse registration order (backward visits them roughly so); the
first bucket is small so communication starts early. Every rank builds the same buckets from
the same parameter order, so the bucket names match across ranks.

Packing and unpacking cost one call each, whatever the bucket's size: the bucket keeps views of
its flat buffer shaped (and strided) like its parameters, made once, and moves every gradient
with one `torch._foreach_copy_` (a multi-tensor kernel) into the buffer before the allreduce and
back into the same `p.grad` tensors after it, as Horovod's in-place allreduce of `p.grad` does.
Gradients never alias the buffer, so one buffer per bucket is enough: the next step's pack is
ordered after this step's unpack on the training stream.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Sequence

import torch

__all__ = ["Bucket", "plan_buckets", "layout_digest", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1024 * 1024


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
        memory_format=torch.channels_last)


def _unflat(seg: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`seg` (1-D, in `param`'s memory order) viewed with `param`'s shape and layout."""
    if _channels_last(param):
        n, c, h, w = param.shape
        return seg.view(n, h, w, c).permute(0, 3, 1, 2)
    return seg.view(param.shape)


class Bucket:
    """Consecutive same-dtype, same-device parameters reduced as one flat tensor."""

    __slots__ = ("params", "name", "index", "numel", "offsets", "flat", "views", "ready",
                 "handle", "send", "cctx", "lock", "member_names", "layout")

    def __init__(self, params: list[torch.Tensor], name: str, index: int = 0,
                 member_names: Sequence[str] | None = None) -> None:
        self.params = params
        self.name = name
        self.index = index  # position in the optimizer's plan
        self.member_names = list(member_names) if member_names is not None else [
            str(i) for i in range(len(params))]
        # The members' shapes and memory layouts, sent with the bucket's allreduce: ranks whose
        # buckets hold the same number of elements in different shapes get a MismatchError
        # instead of summing unrelated gradients.
        self.layout = layout_digest(params)
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.flat: torch.Tensor | None = None  # allocated at the first pack
        self.views: list[torch.Tensor] = []  # per parameter: its slice of `flat`, param-shaped
        self.ready = 0  # members whose gradient is final this step
        self.handle: Any = None
        self.send: torch.Tensor | None = None
        self.cctx: Any = None
        self.lock = threading.Lock()  # hooks may fire on several autograd threads

    def mark_ready(self) -> bool:
        """Counts one final gradient; True when the bucket just became complete."""
        with self.lock:
            self.ready += 1
            return self.ready == len(self.params)

    def _buffer(self) -> torch.Tensor:
        if self.flat is None:
            p0 = self.params[0]
            self.flat = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
            self.views = [_unflat(self.flat[off:off + p.numel()], p)
                          for p, off in zip(self.params, self.offsets)]
        return self.flat

    def pack(self, sparse_as_dense: bool = False) -> torch.Tensor:
        """Copies every member's gradient into the flat buffer (zeros where there is none).
        Sparse gradients are densified into it with `sparse_as_dense`, else they are reduced on
        their own and take zeros here.

        Raises:
            AssertionError: a gradient requires grad (backward(create_graph=True)).
        """
        flat = self._buffer()
        grads = [p.grad for p in self.params]
        if any(g is None or g.is_sparse or g.requires_grad for g in grads):
            for g, view in zip(grads, self.views):
                if g is not None and g.requires_grad:
                    raise AssertionError("DistributedOptimizer does not support gradients that "
                                         "require grad (backward(create_graph=True))")
                if g is None or (g.is_sparse and not sparse_as_dense):
                    view.zero_()
                else:
                    view.copy_(g.to_dense() if g.is_sparse else g)
        else:
            torch._foreach_copy_(self.views, grads)  # any layout: copies follow each view
        return flat

    def unpack(self, reduced: torch.Tensor, sparse_as_dense: bool = False) -> None:
        """Writes the reduced values back into every member's `.grad` (in place; a member
        without a gradient gets a new tensor; with `sparse_as_dense` a sparse one gets the
        result as a new sparse tensor). `reduced` is the flat buffer itself, or a decompressed
        copy of it."""
        flat = self._buffer()
        if reduced is not flat:
            flat.copy_(reduced)
        grads = [p.grad for p in self.params]
        if any(g is None or g.is_sparse for g in grads):
            for p, g, view in zip(self.params, grads, self.views):
                if g is None:
                    p.grad = view.clone()
                elif not g.is_sparse:
                    g.copy_(view)
                elif sparse_as_dense:
                    p.grad = view.to_sparse()
        else:
            torch._foreach_copy_(grads, self.views)

    def describe(self, limit: int = 12) -> str:
        """The members' names and shapes, for error texts."""
        items = [f"{n!r} {tuple(p.shape)}" + (" channels_last" if _channels_last(p) else "")
                 for n, p in zip(self.member_names[:limit], self.params)]
        more = len(self.params) - limit
        return ", ".join(items) + (f" and {more} more" if more > 0 else "")

    def reset(self) -> None:
        self.ready = 0
        self.handle = self.send = self.cctx = None


def layout_digest(params: Sequence[torch.Tensor]) -> int:
    """A nonzero unsigned 64-bit digest of the parameters' shapes and memory layouts, in order."""
    text = ";".join(f"{tuple(p.shape)}{'c' if _channels_last(p) else ''}" for p in params)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def plan_buckets(params: Sequence[torch.Tensor], names: Sequence[str], cap_bytes: int,
                 first_bytes: int = FIRST_BUCKET_BYTES) -> list[tuple[list[int], str]]:
    """Groups parameter indices into buckets, in reverse order, by dtype/device and size.

    Returns (indices, bucket name) pairs; the name is derived from the members' names, so
    it matches across ranks and across optimizers with distinct parameter names.
    """
    out: list[tuple[list[int], str]] = []
    cur: list[int] = []
    cur_bytes = 0
    limit = min(first_bytes, cap_bytes)
    key = None
    for i in reversed(range(len(params))):
        p = params[i]
        k = (p.dtype, p.device)
        nb = p.numel() * p.element_size()
        if cur and (k != key or cur_bytes + nb > limit):
            out.append((cur, f"bucket.{names[cur[0]]}+{len(cur) - 1}"))
            cur, cur_bytes, limit = [], 0, cap_bytes
        cur.append(i)
        cur_bytes += nb
        key = k
    if cur:
        out.append((cur, f"bucket.{names[cur[0]]}+{len(cur) - 1}"))
    return out
