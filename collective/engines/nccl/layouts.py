"""Layouts of the NCCL engine's allgather, alltoall and reducescatter (`engine.NCCLEngine`).

Each function is the body of one engine op, run inside `NCCLEngine._run` (ready events waited,
completion recorded, errors handled there) with the engine's primitives: `_out_ptr` (outputs),
`_fusion_buffer`, `_staged` (pack copies, the NCCL call, unpack copies: one batched-copy
launch each way), `_copies`, `_reduction` and the communicator on the engine stream `_sp`.
Pieces start at 16-byte boundaries (`_pad16`) so the batched copies move 16-byte words.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from cupy.cuda import nccl
from cupy.cuda import runtime as _rt

from ...entry import Entry
from ...types import Response
from ..base import split_rows
from ..device import pointer_of

__all__ = ["allgather", "alltoall", "reducescatter", "gatherv"]

_UINT8 = 1  # ncclUint8
_D2D = 3  # cudaMemcpyDeviceToDevice


def _pad16(n: int) -> int:
    return (n + 15) & ~15


def _row_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def _cumsum0(values: list[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out


def gatherv(eng: Any, src: int, dst: int, counts: list[int]) -> None:
    """Every rank's `counts[r]` bytes into `dst` in rank order (src may lie inside dst)."""
    comm, sp = eng.comm, eng._sp
    if all(c == counts[0] for c in counts):
        if counts[0]:
            comm.allGather(src, dst, counts[0], _UINT8, sp)
        return
    displ = _cumsum0(counts)
    nccl.groupStart()
    try:
        for r, c in enumerate(counts):
            if c:
                comm.broadcast(src if r == eng.rank else dst + displ[r], dst + displ[r], c,
                               _UINT8, r, sp)
    finally:
        nccl.groupEnd()


def allgather(eng: Any, entries: list[Entry], resp: Response) -> None:
    size, me, k = eng.size, eng.rank, len(entries)
    item = resp.dtype.itemsize
    rows = [resp.sizes[t * size:(t + 1) * size] for t in range(k)]
    rbytes = [_row_elems(e.request.shape) * item for e in entries]
    outs = [eng._out_ptr(e, (sum(rows[t]),) + tuple(e.request.shape[1:]))
            for t, e in enumerate(entries)]
    if k == 1:
        act = eng._activity(entries, "NCCL_ALLGATHER")
        gatherv(eng, pointer_of(entries[0].tensor)[0], outs[0],
                      [rows[0][r] * rbytes[0] for r in range(size)])
        eng._activity_end(act)
        return
    nbytes = [[rows[t][r] * rbytes[t] for t in range(k)] for r in range(size)]
    piece_off = [_cumsum0([_pad16(n) for n in nbytes[r]]) for r in range(size)]
    block = [sum(_pad16(n) for n in nbytes[r]) for r in range(size)]
    displ = _cumsum0(block)
    total = sum(block)
    if total == 0:
        return
    buf = eng._fusion_buffer(total, entries[0])
    mine = buf + displ[me]
    pack = ([pointer_of(e.tensor)[0] for e in entries],
            [mine + piece_off[me][t] for t in range(k)], nbytes[me])
    out_off = [_cumsum0([nbytes[r][t] for r in range(size)]) for t in range(k)]
    us, ud, un = [], [], []
    for r in range(size):
        for t in range(k):
            us.append(buf + displ[r] + piece_off[r][t])
            ud.append(outs[t] + out_off[t][r])
            un.append(nbytes[r][t])
    eng._staged(entries, pack, (us, ud, un), "NCCL_ALLGATHER",
                lambda: gatherv(eng, mine, buf, block))


def alltoall(eng: Any, entries: list[Entry]) -> None:
    e = entries[0]
    size, me, comm, sp = eng.size, eng.rank, eng.comm, eng._sp
    splits = np.asarray(e.splits, dtype=np.int64)
    mat = [np.frombuffer(b, dtype=np.int64)
           for b in eng.control.allgather(splits.tobytes())]
    recv = np.array([int(mat[r][me]) for r in range(size)], dtype=np.int64)
    rb = _row_elems(e.request.shape) * e.request.dtype.itemsize
    shape = (int(recv.sum()),) + tuple(e.request.shape[1:])
    out = eng._out_ptr(e, shape)
    src = pointer_of(e.tensor)[0]
    sc = [int(s) * rb for s in splits]
    rc = [int(s) * rb for s in recv]
    sd, rd = _cumsum0(sc), _cumsum0(rc)
    if sc[me]:
        _rt.memcpyAsync(out + rd[me], src + sd[me], sc[me], _D2D, sp)
    act = eng._activity(entries, "NCCL_ALLTOALL")
    nccl.groupStart()
    try:
        for r in range(size):
            if r == me:
                continue
            if sc[r]:
                comm.send(src + sd[r], sc[r], _UINT8, r, sp)
            if rc[r]:
                comm.recv(out + rd[r], rc[r], _UINT8, r, sp)
    finally:
        nccl.groupEnd()
    eng._activity_end(act)
    e.received_splits = recv.astype(np.int32)


def reducescatter(eng: Any, entries: list[Entry], resp: Response) -> None:
    dt = resp.dtype
    ntype, op, pre, post = eng._reduction(dt, resp)
    item, size, me, k = dt.itemsize, eng.size, eng.rank, len(entries)
    comm, sp, kern = eng.comm, eng._sp, eng._kernels
    assert kern is not None
    lay = [(split_rows(e.request.shape[0], size), _row_elems(e.request.shape))
           for e in entries]
    counts = [[rs[r] * row for r in range(size)] for rs, row in lay]  # elements
    outs = [eng._out_ptr(e, (lay[t][0][me],) + tuple(e.request.shape[1:]))
            for t, e in enumerate(entries)]
    per_rank = [sum(counts[t][r] for t in range(k)) for r in range(size)]
    act_name = "NCCL_REDUCESCATTER"
    if k == 1 and pre == 1.0 and all(c == per_rank[0] for c in per_rank):
        c = per_rank[0]
        if c:
            act = eng._activity(entries, act_name)
            comm.reduceScatter(pointer_of(entries[0].tensor)[0], outs[0], c, ntype, op, sp)
            eng._activity_end(act)
            kern.scale(outs[0], c, dt, post)
        return
    piece = [[_pad16(counts[t][r] * item) for t in range(k)] for r in range(size)]
    in_block = [_cumsum0(piece[r]) for r in range(size)]
    block = max(sum(piece[r]) for r in range(size))
    if block == 0:
        return
    buf = eng._fusion_buffer(size * block + block, entries[0])
    recv = buf + size * block
    ps, pd, pn = [], [], []
    for t, e in enumerate(entries):
        src = pointer_of(e.tensor)[0]
        start = 0
        for r in range(size):
            nb = counts[t][r] * item
            ps.append(src + start)
            pd.append(buf + r * block + in_block[r][t])
            pn.append(nb)
            start += nb
    unpack = ([recv + in_block[me][t] for t in range(k)], outs,
              [counts[t][me] * item for t in range(k)])
    count = block // item

    def reduce() -> None:
        kern.scale(buf, size * count, dt, pre)
        comm.reduceScatter(buf, recv, count, ntype, op, sp)
        kern.scale(recv, count, dt, post)
    eng._staged(entries, (ps, pd, pn), unpack, act_name, reduce)
