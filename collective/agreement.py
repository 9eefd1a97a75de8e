"""What `init()` makes the ranks agree on, and the plain-data messages of process-set changes.

`agree` is init()'s exchange over the world's control plane: every rank takes rank 0's values
of the options that shape what the ranks exchange, and every rank checks the `process_sets`
that all passed. `change_of` decodes one rank's entry of a dynamic process-set change
(`Runtime._sync_process_set_changes`). Messages are JSON, bounds-checked (never pickle).
"""
from __future__ import annotations

import json
from typing import Any

from . import _log
from .config import SHARED_OPTIONS, Config
from .process_sets import ProcessSet
from .wire import MAX_STR_BYTES, WireError

__all__ = ["agree", "ranks_here", "common_set", "static_sets", "change_of"]

_log_ = _log.get_logger()


def agree(control: Any, config: Config,
          process_sets: Any) -> tuple[Config, list[tuple[list[list[int]], list[int] | None]]]:
    """The exchange of `init()`, collective over the world plane: every rank takes rank 0's
    values of the options that shape what the ranks exchange (`Option.shared`), warning where
    its own differ, and every rank checks that all passed the same `process_sets` ("dynamic"
    on all or none; the same static sets, a communicator counting as its world ranks). At a
    place of the list where some rank passed an mpi4py communicator, the ranks may pass the
    different communicators of one split (`MPI.COMM_WORLD.Split`), as in Horovod: each one is
    a set (`static_sets`).

    Returns:
        the config to use and, per static set in the order given, the sets to register there
        (sorted; one, unless communicators of a split) and the ranks of the one this rank's
        `ProcessSet` becomes (None: a rank outside every communicator of a split of several).

    Raises:
        ValueError: the ranks passed different process sets (on every rank alike).
    """
    static = process_sets if isinstance(process_sets, (list, tuple)) else []
    here = [ranks_here(ps, control) for ps in static]
    mine = {"options": {o.field: getattr(config, o.field) for o in SHARED_OPTIONS},
            "sets": "dynamic" if process_sets == "dynamic" else here,
            "comms": [ps.mpi_comm is not None for ps in static]}
    views = [_agreement_of(b, r)
             for r, b in enumerate(control.allgather(json.dumps(mine).encode()))]
    compared = [sets for _, sets, _ in views]
    if "dynamic" in compared:
        # "dynamic" turns on what HOROVOD_DYNAMIC_PROCESS_SETS=1 does: a rank that has the
        # variable set and passes no static sets (a survivor re-initialized after an elastic
        # reset, too) agrees with it.
        compared = ["dynamic" if sets == [] and opts["dynamic_process_sets"] else sets
                    for opts, sets, _ in views]
    comms = [c for _, _, c in views]
    agreed = static_sets(compared, comms)
    if agreed is None:
        by: dict[str, list[int]] = {}
        for r, (_, sets, _) in enumerate(views):
            shown = '"dynamic"' if isinstance(sets, str) else "[" + ", ".join(
                "COMM_NULL" if s is None else str(s) for s in sets) + "]"
            if compared[r] != sets:
                shown += " with HOROVOD_DYNAMIC_PROCESS_SETS=1"
            by.setdefault(shown, []).append(r)
        raise ValueError(
            "ranks passed different process sets to init(): "
            + "; ".join(f"ranks {who} passed {shown}" for shown, who in by.items())
            + ". Every rank must pass the same process_sets to hvd.init(), in the same order."
            + (' For dynamic process sets, pass process_sets="dynamic" on every rank or set '
               "HOROVOD_DYNAMIC_PROCESS_SETS=1." if '"dynamic"' in by else "")
            + (" Sets of mpi4py communicators may differ across ranks as the communicators of "
               "one split do (MPI.COMM_WORLD.Split): every member of a communicator must pass "
               "it, or its ranks, at the same place in the list." if any(map(any, comms))
               else ""))
    ours = views[0][0]
    changes: dict[str, Any] = {}
    for o in SHARED_OPTIONS:
        own = getattr(config, o.field)
        if ours[o.field] != own:
            _log_.warning("%s is %r on this rank but %r on rank 0; every rank uses rank 0's "
                          "value", o.env, own, ours[o.field])
            changes[o.field] = ours[o.field]
    placed = [(sets, own if own is not None else sets[0] if len(sets) == 1 else None)
              for sets, own in zip(agreed, here)]
    return (config.replace(**changes) if changes else config), placed


def ranks_here(ps: ProcessSet, control: Any) -> list[int] | None:
    """A static set's sorted world ranks as this rank knows them: a communicator's members
    translated into the world plane's communicator; None for `MPI.COMM_NULL` (this rank is not
    a member; the members' entries say who is)."""
    if ps.mpi_comm is None:
        return ps.ranks
    from mpi4py import MPI  # only reached for a set built from an mpi4py communicator
    comm = ps.mpi_comm
    if comm == MPI.COMM_NULL:
        return None
    world = getattr(control, "comm", MPI.COMM_WORLD).Get_group()
    group = comm.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def common_set(entries: list[list[int] | None]) -> list[int] | None:
    """The static set that every rank's entry (`ranks_here`) at one place names alike, COMM_NULL
    (None) taking the members' ranks; None where the ranks disagree: other sets, or a COMM_NULL
    on a rank that the set includes."""
    known = {tuple(e) for e in entries if e is not None}
    if len(known) > 1:
        return None
    ranks = list(known.pop()) if known else []
    if any(e is None and r in ranks for r, e in enumerate(entries)):
        return None
    return ranks


def static_sets(views: list[str | list[list[int] | None]],
                comms: list[list[bool]]) -> list[list[list[int]]] | None:
    """Per place of init()'s static sets, the sets to register there, from every rank's
    entries (`ranks_here` of each, or "dynamic") and whether each was a communicator; None
    where the ranks disagree ("dynamic" on some only, other counts). Where no rank passed a
    communicator, every rank must name the same set (`common_set`). Where one did, each
    distinct set named there is registered, as Horovod registers every communicator of a
    split, provided each of its members named it (not another set, not COMM_NULL); a rank
    outside all of them passes COMM_NULL or one of their rank lists."""
    if any(isinstance(v, str) for v in views):
        return [] if all(v == "dynamic" for v in views) else None
    if len({len(v) for v in views}) != 1:
        return None
    out: list[list[list[int]]] = []
    for i in range(len(views[0])):
        entries = [v[i] for v in views]  # type: ignore[index]
        if any(c[i] for c in comms):
            named = sorted({tuple(e) for e in entries if e is not None})
            size = len(entries)
            if any(0 <= r < size and (entries[r] is None or tuple(entries[r]) != s)
                   for s in named for r in s):
                return None
            out.append([list(s) for s in named])
        else:
            one = common_set(entries)
            if one is None:
                return None
            out.append([one] if one else [])
    return out


def _json(data: bytes, rank: int, what: str) -> Any:
    if len(data) > MAX_STR_BYTES:
        raise WireError(f"rank {rank} sent {what} of {len(data)} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"rank {rank} sent malformed {what}: {exc}") from None


def _rank_list(v: Any, rank: int, what: str) -> list[int]:
    # Ranks out of range (or too many of them) are the caller's mistake, which the change's
    # registration reports on every rank alike (`Runtime._add_static`), not a broken message.
    if not isinstance(v, list) or not all(type(r) is int for r in v):
        raise WireError(f"rank {rank} sent {what} that is not a list of ranks: {str(v)[:80]}")
    return v


def _agreement_of(data: bytes, rank: int
                  ) -> tuple[dict[str, Any], str | list[list[int] | None], list[bool]]:
    v = _json(data, rank, "init's settings")
    options = v.get("options") if isinstance(v, dict) else None
    sets = v.get("sets") if isinstance(v, dict) else None
    comms = v.get("comms") if isinstance(v, dict) else None
    if not (isinstance(options, dict)
            and all(_of_type(options.get(o.field), o.default) for o in SHARED_OPTIONS)
            and (sets == "dynamic" or isinstance(sets, list)
                 and all(s is None or isinstance(s, list) and all(type(r) is int for r in s)
                         for s in sets))
            and isinstance(comms, list) and all(type(c) is bool for c in comms)
            and len(comms) == (0 if sets == "dynamic" else len(sets))):
        raise WireError(f"rank {rank} sent malformed init settings: {str(v)[:80]}")
    return options, sets, comms


def _of_type(value: Any, default: Any) -> bool:
    """`value` has the type of an option whose default is `default` (an int does for a float)."""
    return type(value) is type(default) or type(default) is float and type(value) is int


def change_of(data: bytes, rank: int) -> tuple | None:
    v = _json(data, rank, "a process set change")
    if v is None:
        return None
    if isinstance(v, list) and len(v) == 2 and v[0] == "add":
        return ("add", None if v[1] is None else _rank_list(v[1], rank, "a process set change"))
    if isinstance(v, list) and len(v) == 2 and v[0] == "remove" and type(v[1]) is int:
        return ("remove", v[1])
    raise WireError(f"rank {rank} sent a malformed process set change: {str(v)[:80]}")
