"""In-process transport: N threads of one process act as N ranks (unit tests, overhead
benchmarks), and the size-1 world of a plain `python train.py`.

Every primitive is an allgather of Python objects through a pair of barriers, so it is simple and
obviously correct rather than fast.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import CollectiveTimeoutError, HorovodInternalError
from ..types import ReduceOp
from .base import ControlPlane, HostEngine

__all__ = ["LoopbackWorld", "LoopbackControlPlane", "LoopbackEngine", "create_backend",
           "create_single_backend", "create_engine"]

_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}


class _Exchange:
    """Allgather of Python objects among `n` threads."""

    def __init__(self, n: int, timeout: float) -> None:
        self.n = n
        self.timeout = timeout
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n)
        self.reason = ""

    def _wait(self) -> None:
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            if self.reason:
                raise HorovodInternalError(f"loopback group aborted: {self.reason}") from None
            raise CollectiveTimeoutError(
                f"a loopback peer did not arrive within {self.timeout} s") from None

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        if self.n == 1:
            return [obj]
        self.slots[rank] = obj
        self._wait()
        out = list(self.slots)
        self._wait()
        return out

    def abort(self, reason: str) -> None:
        self.reason = reason or "aborted"
        self.barrier.abort()


class LoopbackWorld:
    """Shared state of an in-process world; hand `plane(rank)` to each rank's thread."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.exchange = _Exchange(size, timeout)

    def plane(self, rank: int) -> "LoopbackControlPlane":
        return LoopbackControlPlane(self.exchange, rank, list(range(self.size)))


class LoopbackControlPlane(ControlPlane):
    name = "loopback"

    def __init__(self, exchange: _Exchange, rank: int, global_ranks: list[int]) -> None:
        self.ex = exchange
        self.rank, self.size = rank, exchange.n
        self.global_ranks = global_ranks

    def gather(self, data: bytes) -> list[bytes] | None:
        out = self.ex.allgather(self.rank, data)
        return out if self.rank == 0 else None

    def bcast(self, data: bytes | None) -> bytes:
        return self.ex.allgather(self.rank, data)[0]

    def allreduce_words(self, words: np.ndarray, op: str) -> np.ndarray:
        parts = self.ex.allgather(self.rank, words.copy())
        fn = np.bitwise_and if op == "and" else np.bitwise_or
        return fn.reduce(np.stack(parts), axis=0)

    def allgather(self, data: bytes) -> list[bytes]:
        return self.ex.allgather(self.rank, data)

    def barrier(self) -> None:
        self.ex.allgather(self.rank, None)

    def exchange(self, obj: Any) -> list[Any]:
        return self.ex.allgather(self.rank, obj)

    def split(self, ranks: Sequence[int]) -> "LoopbackControlPlane | None":
        ranks = sorted(ranks)
        me = self.global_ranks[self.rank]
        proposal = _Exchange(len(ranks), self.ex.timeout) if me == ranks[0] else None
        views = self.ex.allgather(self.rank, proposal)
        if me not in ranks:
            return None
        ex = views[self.global_ranks.index(ranks[0])]
        return LoopbackControlPlane(ex, ranks.index(me), list(ranks))

    def abort(self, reason: str = "") -> None:
        self.ex.abort(reason)


class LoopbackEngine(HostEngine):
    name = "loopback"
    prefix = "LOOPBACK"
    reduces_float16 = True

    def __init__(self, control: LoopbackControlPlane, fusion_threshold: int) -> None:
        super().__init__(control, fusion_threshold)
        self.plane = control

    def _allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        parts = self.plane.exchange(buf.copy())
        acc = parts[0].copy()
        for p in parts[1:]:
            _REDUCE[op](acc, p, out=acc)
        buf[...] = acc

    def _allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        parts = self.plane.exchange(send.copy())
        off = 0
        for p, c in zip(parts, counts):
            recv[off:off + c] = p[:c]
            off += c

    def _broadcast(self, buf: np.ndarray, root: int) -> None:
        parts = self.plane.exchange(buf.copy() if self.rank == root else None)
        buf[...] = parts[root]

    def _alltoallv(self, send: np.ndarray, sendcounts: list[int], recv: np.ndarray,
                   recvcounts: list[int]) -> None:
        offs = np.concatenate([[0], np.cumsum(sendcounts)]).astype(int)
        blocks = [send[offs[r]:offs[r + 1]].copy() for r in range(self.size)]
        parts = self.plane.exchange(blocks)
        off = 0
        for r in range(self.size):
            b = parts[r][self.rank]
            recv[off:off + b.size] = b
            off += b.size

    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                        op: ReduceOp) -> None:
        full = send.copy()
        self._allreduce(full, op)
        start = sum(counts[:self.rank])
        recv[...] = full[start:start + counts[self.rank]]

    def _barrier(self) -> None:
        self.plane.barrier()


def create_backend(config: Any, world: LoopbackWorld | None = None, rank: int = 0,
                   **_: Any) -> LoopbackControlPlane:
    if world is None:
        raise ValueError("the loopback backend needs world=LoopbackWorld(n) and rank=")
    return world.plane(rank)


def create_single_backend(config: Any, **_: Any) -> LoopbackControlPlane:
    return LoopbackWorld(1).plane(0)


def create_engine(control: Any, config: Any) -> LoopbackEngine:
    return LoopbackEngine(control, config.fusion_threshold)
