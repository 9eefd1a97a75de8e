"""Execution: one agreed response runs on its engine, and its handles complete.

Errors and join/barrier responses complete their handles directly. Data responses take their
entries out of the tensor table (a rank that joined contributes zeros of the agreed shape) and
run on the process set's host engine or, for device buffers, its device engine, created on the
first device response (every rank of the set gets that response at the same point, so the
engine's collective setup lines up). A gradient set's agreed members (`SetChunk`) run the same
way, as one in-place (fused) allreduce whose entries the set builds (collective/gradset.py).
"""
from __future__ import annotations

from typing import Any

from ..engines import create_engine
from ..engines.device import release_ready
from ..entry import Entry
from ..errors import HorovodInternalError, MismatchError
from ..gradset import SetChunk
from ..handle import Handle
from ..types import CPU_DEVICE, Request, RequestType, Response, ResponseType
from .state import ProcessSetState, shutdown_error

__all__ = ["perform", "engine_for"]

# Enum members read once (a class attribute read of an enum is slow, and this is per op).
_R_ERROR, _R_JOIN, _R_BARRIER = ResponseType.ERROR, ResponseType.JOIN, ResponseType.BARRIER
_R_ALLREDUCE, _R_ADASUM, _R_ALLGATHER = (ResponseType.ALLREDUCE, ResponseType.ADASUM,
                                         ResponseType.ALLGATHER)
_R_BROADCAST, _R_ALLTOALL, _R_REDUCESCATTER = (ResponseType.BROADCAST, ResponseType.ALLTOALL,
                                               ResponseType.REDUCESCATTER)


def perform(ps: ProcessSetState, resp: Response, tl: Any, device_engine: str,
            config: Any, tuner: Any = None) -> None:
    """Runs `resp` on this rank and completes its handles. `tl`: the set's timeline
    (`ProcessSetState.timeline`: global rank 0 only) or None; `device_engine`: the registered
    name of the device engine; `tuner`: autotune's `Driver` on global rank 0 while tuning runs, else None (it
    records the global set's allreduces).

    Raises:
        whatever the engine raises, after failing the response's handles with it.
    """
    if type(resp) is SetChunk:
        _perform_chunk(ps, resp, tl, device_engine, config, tuner)
        return
    t = resp.type
    if t == _R_ERROR:
        exc = MismatchError(resp.error)
        failed = []
        for name in resp.names:
            e = ps.pop(name)
            if tl is not None:
                tl.end_error(name)
            if e is not None:
                ps.forget(e.request)
                e.handle._set_exception(exc)
                failed.append(e)
        release_ready(failed)
        return
    if t == _R_JOIN or t == _R_BARRIER:
        e = ps.pop(resp.names[0])
        if e is not None:
            e.handle._set_result(resp.last_joined_rank if t == _R_JOIN else None)
        return
    entries: list[Entry] = []
    device = resp.device
    engine = engine_for(ps, device, device_engine, config)
    with ps.lock:
        popped = [ps.table.pop(name, None) for name in resp.names]
    zeros_on = None
    for i, name in enumerate(resp.names):
        e = popped[i]
        if e is None:  # this rank joined: contribute zeros of the agreed size
            shape = resp.shapes[i] if resp.shapes else (resp.sizes[i],)
            if zeros_on is None:  # the device this rank named at its join (not the peers')
                zeros_on = device if device == CPU_DEVICE else ps.join_device()
            z = engine.zeros(shape, resp.dtype, zeros_on)
            e = Entry(Request(rank=ps.rank, type=RequestType(int(resp.type)), name=name,
                              dtype=resp.dtype, shape=shape, device=device),
                      z, Handle(name), output=z)
        entries.append(e)
    _run(ps, resp, entries, engine, tl, tuner)


def _perform_chunk(ps: ProcessSetState, chunk: SetChunk, tl: Any, device_engine: str,
                   config: Any, tuner: Any) -> None:
    """Agreed members of a gradient set (collective/gradset.py): one in-place allreduce
    (fused when several), whose completion the set records."""
    gset = chunk.gset
    engine = engine_for(ps, gset.device, device_engine, config)
    handle = Handle("gradient set")  # shared by the chunk's entries
    entries = gset.entries(chunk, engine, handle)
    try:
        _run(ps, chunk.response(), entries, engine, tl, tuner)
    except BaseException as exc:
        gset.fail(shutdown_error(exc))
        raise
    if handle.exception() is not None:  # the op failed on this rank only (the job goes on)
        gset.fail(handle.exception())
        return
    gset.ran(chunk, handle._result)


def _run(ps: ProcessSetState, resp: Response, entries: list[Entry], engine: Any, tl: Any,
         tuner: Any) -> None:
    """Runs a data response's entries on `engine` and completes their handles."""
    t = resp.type
    if tl is not None:
        for e in entries:
            tl.start(e.name, resp.type.name)
    try:
        if t == _R_ALLREDUCE or t == _R_ADASUM:
            engine.allreduce(entries, resp)
            if tuner is not None and t == _R_ALLREDUCE and ps.id == 0:
                tuner.record(resp.names, sum(resp.sizes) * resp.dtype.itemsize)
        elif t == _R_ALLGATHER:
            engine.allgather(entries, resp)
        elif t == _R_BROADCAST:
            engine.broadcast(entries[0], ps.ranks.index(resp.root))
        elif t == _R_ALLTOALL:
            engine.alltoall(entries[0])
        elif t == _R_REDUCESCATTER:
            engine.reducescatter(entries, resp)
        else:  # pragma: no cover - negotiation never produces other types
            raise HorovodInternalError(f"unexpected response type {t.name} for {resp.names}")
        for e in entries:
            if tl is not None:
                out = e.output
                tl.end(e.name, resp.dtype.label, tuple(getattr(out, "shape", ())))
            h = e.handle
            if not h.done():  # a gradient set's chunk shares one handle: complete it once
                h._set_result(engine.finish(e))
    except BaseException as exc:
        # These entries already left the table, so the loop's exit path (fail_all) cannot
        # reach them: fail them here or their waiters hang forever.
        err = shutdown_error(exc)
        for e in entries:
            if tl is not None:
                tl.end_error(e.name)
            e.handle._set_exception(err)
        raise


def engine_for(ps: ProcessSetState, device: int, device_engine: str, config: Any) -> Any:
    """The engine of `ps` for `device` (CPU_DEVICE: the host engine)."""
    if device == CPU_DEVICE:
        return ps.host_engine
    if ps.device_engine is None:
        ps.device_engine = create_engine(device_engine, ps.control, config)
        ps.device_engine.timeline = ps.host_engine.timeline
    return ps.device_engine
