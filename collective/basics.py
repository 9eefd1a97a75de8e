"""Lifecycle and topology queries: `init`, `shutdown`, `rank`, `size`, ... and process sets."""
from __future__ import annotations

import sys
from typing import Any, Sequence

from . import _current as _rt
from ._log import get_logger
from .config import update_environ, warn_no_effect
from .errors import HorovodInternalError, NotInitializedError
from .handle import Handle
from .process_sets import ProcessSet, global_process_set
from .runtime import Runtime

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "mpi_threads_supported", "nccl_built", "cuda_built",
           "rocm_built", "ddl_built", "ccl_built", "add_process_set", "remove_process_set",
           "start_timeline", "stop_timeline", "mode"]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Starts ringvod in this process (idempotent). Reads the environment now.

    Args:
        comm: None (the whole job), a list of world ranks that run ringvod, or an mpi4py
            communicator (MPI mode).
        process_sets: None, a list of `ProcessSet` (every rank passes the same list; a set
            of an mpi4py communicator counts as its ranks, and at a place of the list each
            rank may pass its own communicator of one split, e.g. `MPI.COMM_WORLD.Split(...)`:
            every communicator becomes a set, and each rank's `ProcessSet` the one it is in),
            or "dynamic" (on every rank) to
            allow `add_process_set`/`remove_process_set` later. As in Horovod, "dynamic"
            sets HOROVOD_DYNAMIC_PROCESS_SETS=1 in this process, so a later `init()` (after
            `shutdown()`, or an elastic reset) keeps dynamic process sets on.

    An `init()` that raises leaves ringvod uninitialised: what it had set up (connections,
    threads, process set ids) is released and `is_initialized()` is False. When it raised on
    every rank alike (different or duplicate process sets), `init()` may be called again.

    In an elastic job, the process's first `init()` asks the driver for its place again when
    the world it was placed in fails to form (a peer died meanwhile), as a reset does, instead
    of failing the worker (and blacklisting its host).

    Raises:
        ValueError: duplicate or invalid process sets, or process sets that differ across
            ranks (raised on every rank).
        EngineUnavailableError: the detected mode needs a package that is not installed.
        HorovodInternalError: the world failed to form (elastic: 20 times in a row).
    """
    if _rt.current_or_none() is not None:
        return
    if process_sets == "dynamic":
        update_environ({"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    first = _elastic_inits() == 0
    attempt = 0
    while True:
        try:
            rt = Runtime.create(comm=comm, process_sets=process_sets)
            break
        except HorovodInternalError as exc:
            attempt += 1
            # Only the first elastic rendezvous of this process (later ones are resets, which
            # retry themselves). Safe: the driver never makes a worker that has not received
            # the job's state rank 0 while one that holds it is left.
            if not first or _elastic_inits() == 0 or attempt >= _ELASTIC_FIRST_INIT_ATTEMPTS:
                raise
            get_logger().warning("elastic: the first rendezvous failed (%s); asking the "
                                 "driver for a place again", str(exc).strip().split("\n")[0])
    try:
        if rt.rank == 0:
            warn_no_effect(rt.config, rt.mode)
        _rt.set_current(rt)
        rt.start()
    except BaseException as exc:
        _rt.set_current(None)
        rt.abandon(f"init() failed on rank {rt.rank}: {type(exc).__name__}: {exc}")
        raise


# How many times an elastic worker's first init() asks the driver for a place (as a reset).
_ELASTIC_FIRST_INIT_ATTEMPTS = 20


def _elastic_inits() -> int:
    """`elastic.rendezvous_count()`, 0 while `elastic` is unloaded (as in jobs not elastic)."""
    elastic = sys.modules.get(f"{__package__}.elastic")
    return elastic.rendezvous_count() if elastic is not None else 0


def shutdown() -> None:
    """Stops the background thread on every rank; `init()` may be called again afterwards."""
    rt = _rt.current_or_none()
    if rt is None:
        return
    try:
        rt.shutdown()
    finally:
        _rt.set_current(None)


def is_initialized() -> bool:
    return _rt.current_or_none() is not None


def rank() -> int:
    """This process's rank in the job.

    Raises:
        ValueError: before `init()` ("Horovod has not been initialized; use hvd.init().").
    """
    return _rt.current().rank


def size() -> int:
    """Number of processes in the job (raises ValueError before `init()`)."""
    return _rt.current().size


def local_rank() -> int:
    """Rank among the processes on this host (raises ValueError before `init()`)."""
    return _rt.current().local_rank


def local_size() -> int:
    """Number of processes on this host (raises ValueError before `init()`)."""
    return _rt.current().local_size


def cross_rank() -> int:
    """Index of this host among the hosts that have this local rank."""
    return _rt.current().cross_rank


def cross_size() -> int:
    """Number of hosts that have this local rank."""
    return _rt.current().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return _rt.current().is_homogeneous


def mode() -> str:
    """The runtime's mode: 'mpi', 'tcp', 'single' or 'loopback'."""
    return _rt.current().mode


def mpi_built() -> bool:
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    rt = _rt.current_or_none()
    return rt is not None and rt.mode == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE.

    Raises:
        ValueError: MPI is not in use.
    """
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled; mpi_threads_supported() needs MPI mode.")
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return True  # the tcp mode plays Gloo's role and needs nothing extra


def gloo_enabled() -> bool:
    rt = _rt.current_or_none()
    return rt is not None and rt.mode == "tcp"


def nccl_built() -> int:
    """NCCL version code seen through CuPy (e.g. 22806), or 0 when CuPy/NCCL is absent."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - optional
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return 0


def cuda_built() -> bool:
    return nccl_built() > 0


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set after `init(process_sets="dynamic")`; every rank must call it.

    Raises:
        ValueError: dynamic process sets are off, or the set already exists.
    """
    rt = _rt.current()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    h: Handle = rt.request_process_set_change("add", ps)
    return h.wait()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a registered process set; every rank must call it. Returns False, as Horovod
    does, for a set that is not registered and for the global set (which is never removed).

    Raises:
        ValueError: dynamic process sets are off (for a registered set other than the global
            one).
    """
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or process_set is global_process_set:
        return False
    rt = _rt.current()
    return rt.request_process_set_change("remove", ps_id).wait()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing the timeline to `file_path` (needs HOROVOD_TIMELINE=DYNAMIC at init).

    Raises:
        ValueError: not initialised, or the timeline was not enabled at init.
    """
    rt = _rt.current_or_none()
    if rt is None:
        raise NotInitializedError()
    if not rt.timeline_enabled:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    tl = rt.coordinator.timeline
    if tl is not None:
        tl.start_file(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops writing the timeline (a no-op with an info log when it is not running, also when
    the job has no timeline at all, as in Horovod).

    Raises:
        ValueError: not initialised.
    """
    rt = _rt.current_or_none()
    if rt is None:
        raise NotInitializedError()
    if not rt.timeline_enabled:
        get_logger().info("Timeline is already stopped (HOROVOD_TIMELINE was not set at "
                          "init); ignoring the stop request.")
        return
    tl = rt.coordinator.timeline
    if tl is not None:
        tl.stop_file()
