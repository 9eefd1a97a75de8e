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

_ALLGATHER, _REDUCESCATTER = ResponseType.ALLGATHER, ResponseType.REDUCESCATTER
_REDUCTIONS = frozenset((ResponseType.ALLREDUCE, ResponseType.ADASUM, _REDUCESCATTER))
_FUSABLE = _REDUCTIONS | {_ALLGATHER}
_BARRIERS = frozenset((ResponseType.JOIN, ResponseType.BARRIER, ResponseType.ERROR))


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
    t = r.type
    if t in _REDUCTIONS:
        item = r.dtype.itemsize
        if align <= 1 or t == _REDUCESCATTER:  # reducescatter members are not padded
            return sum(r.sizes) * item
        return sum(_pad(n * item, align) for n in r.sizes)
    if t == _ALLGATHER:
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
    if a.type == _ALLGATHER:
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
    if threshold <= 0:
        return list(responses)
    # (response, its bytes), each size computed once: a response skipped by one head's
    # look-ahead is looked at again by the next.
    queue = deque((r, response_bytes(r, group_size, align)) for r in responses)
    out: list[Response] = []
    while queue:
        head, used = queue.popleft()
        if head.type not in _FUSABLE:
            out.append(head)
            continue
        merged = False  # head is copied before its first merge, so inputs stay untouched
        gather = head.type == _ALLGATHER
        # Allgather fits when every rank's summed share fits (as in Horovod).
        ranks_used = _per_rank(head, group_size, align) if gather else []
        skipped: list[tuple[Response, int]] = []
        skipped_bytes = 0
        while queue:
            nxt, nb = queue[0]
            if nxt.type in _BARRIERS:
                break
            if _compatible(head, nxt, disable_group_fusion):
                if gather:
                    summed = [a + b for a, b in zip(ranks_used, _per_rank(nxt, group_size,
                                                                          align))]
                    if max(summed, default=0) > threshold:
                        break
                    ranks_used = summed
                    used = max(summed, default=0)
                elif used + nb > threshold:
                    break
                else:
                    used += nb
                if not merged:
                    head, merged = _copy(head), True
                _merge(head, queue.popleft()[0])
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
