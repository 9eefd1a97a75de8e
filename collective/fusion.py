"""Fusion planning: which consecutive ready responses share one fusion buffer.

A pure function of the ordered response list, so every rank computes the same plan from the same
input (the fast path fuses locally from the response cache). Packing is the engine's job.

Rules (Horovod's): ALLREDUCE/ADASUM/REDUCESCATTER fuse with later responses of the same type,
device, dtype, scale factors and reduce op while the bytes fit under the threshold; ALLGATHER
fuses by per-rank byte sums. A non-matching response is skipped (kept for later, in order) only
while the accumulated plus skipped bytes still fit. BROADCAST, ALLTOALL, JOIN, BARRIER and ERROR
never fuse; JOIN, BARRIER and ERROR also stop the look-ahead.

Device allreduces fuse whatever their size: the NCCL engine reduces a fused op's members of
1 MiB or more where they lie, each by an NCCL call of its own in the op's NCCL group, so fusing
costs a large member no copies through the fusion buffer (`engines/nccl/engine.py`).
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

from .types import Response, ResponseType

__all__ = ["plan_fusion", "response_bytes"]

_REDUCTIONS = (ResponseType.ALLREDUCE, ResponseType.ADASUM, ResponseType.REDUCESCATTER)
_BARRIERS = (ResponseType.JOIN, ResponseType.BARRIER, ResponseType.ERROR)


def _pad(n: int, align: int) -> int:
    return n if align <= 1 else (n + align - 1) // align * align


def _row_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def _per_rank(r: Response, group_size: int, align: int) -> list[int]:
    """Allgather: bytes each rank contributes to the fused buffer."""
    item = r.dtype.itemsize
    per_rank = [0] * group_size
    for t, shape in enumerate(r.shapes):
        row = _row_elems(shape) * item
        for rank in range(group_size):
            per_rank[rank] += _pad(r.sizes[t * group_size + rank] * row, align)
    return per_rank


def response_bytes(r: Response, group_size: int, align: int = 0) -> int:
    """Bytes the response adds to a fusion buffer (allgather: the largest per-rank share)."""
    item = r.dtype.itemsize
    if r.type in _REDUCTIONS:
        pad = 0 if r.type == ResponseType.REDUCESCATTER else align
        return sum(_pad(n * item, pad) for n in r.sizes)
    if r.type == ResponseType.ALLGATHER:
        return max(_per_rank(r, group_size, align), default=0)
    return 0


_MEMBER = re.compile(r"_\d+of\d+$")


def group_key(name: str) -> str:
    """The grouped op a tensor belongs to (`grouped_allreduce.g_2of3` -> `grouped_allreduce.g`);
    any other tensor is a group of its own. Derived from the name, so it matches across ranks."""
    if name.startswith("grouped_"):
        return _MEMBER.sub("", name)
    return name


def _compatible(a: Response, b: Response, by_group: bool) -> bool:
    if a.type != b.type or a.device != b.device or a.dtype != b.dtype:
        return False
    if by_group and group_key(a.names[0]) != group_key(b.names[0]):
        return False
    if a.type == ResponseType.ALLGATHER:
        return True
    return (a.reduce_op == b.reduce_op and a.prescale == b.prescale
            and a.postscale == b.postscale)


def _merge(into: Response, other: Response) -> None:
    into.names.extend(other.names)
    into.sizes.extend(other.sizes)
    into.shapes.extend(other.shapes)


def plan_fusion(responses: Iterable[Response], threshold: int, group_size: int,
                align: int = 0, disable_group_fusion: bool = False) -> list[Response]:
    """Returns the fused responses in execution order. Inputs are not modified."""
    queue = deque(responses)
    out: list[Response] = []
    while queue:
        head = queue.popleft()
        merged = False  # head is copied before its first merge, so inputs stay untouched
        fusable = head.type in _REDUCTIONS or head.type == ResponseType.ALLGATHER
        if not fusable or threshold <= 0:
            out.append(head)
            continue
        gather = head.type == ResponseType.ALLGATHER
        # Allgather fits when every rank's summed share fits (as in Horovod).
        ranks_used = _per_rank(head, group_size, align) if gather else []
        used = response_bytes(head, group_size, align)
        skipped: list[Response] = []
        skipped_bytes = 0
        while queue:
            nxt = queue[0]
            if nxt.type in _BARRIERS:
                break
            nb = response_bytes(nxt, group_size, align)
            if _compatible(head, nxt, disable_group_fusion):
                if gather:
                    summed = [a + b for a, b in zip(ranks_used, _per_rank(nxt, group_size,
                                                                          align))]
                    if max(summed, default=0) > threshold:
                        break
                    ranks_used = summed
                    if not merged:
                        head, merged = _copy(head), True
                    _merge(head, queue.popleft())
                    used = max(summed, default=0)
                    continue
                if used + nb > threshold:
                    break
                if not merged:
                    head, merged = _copy(head), True
                _merge(head, queue.popleft())
                used += nb
            elif used + skipped_bytes + nb <= threshold:
                skipped.append(queue.popleft())
                skipped_bytes += nb
            else:
                break
        queue.extendleft(reversed(skipped))
        out.append(head)
    return out


def _copy(r: Response) -> Response:
    return Response(type=r.type, names=list(r.names), dtype=r.dtype, device=r.device,
                    sizes=list(r.sizes), reduce_op=r.reduce_op, prescale=r.prescale,
                    postscale=r.postscale, root=r.root, error=r.error,
                    last_joined_rank=r.last_joined_rank, shapes=list(r.shapes))
