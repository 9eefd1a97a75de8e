"""Framework-agnostic helpers shared by the adapters: parameter naming rules, list splitting,
object (de)serialisation for `broadcast_object` / `allgather_object`, and the process-set
queries (`process_set_size`, `process_set_rank`).

Nothing here imports a framework; adapters pass plain Python values in.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from typing import Any, Hashable, Iterable, Sequence, TypeVar

import numpy as np

import collective
from collective import ProcessSet, ReduceOp, global_process_set

__all__ = ["find_duplicates", "check_named_parameters", "default_parameter_name", "split_list",
           "dumps", "loads", "broadcast_object", "allgather_object", "process_set_size",
           "process_set_rank", "gradient_reduction"]

T = TypeVar("T")

# As the adapters' code objects spell their file names (both come from the import path).
_PACKAGE_DIR = os.path.dirname(__file__) + os.sep


def default_parameter_name(group_index: int, param_index: int) -> str:
    """Name of an unnamed parameter's gradient: `allreduce.noname.<group>.<index>`.

    Horovod numbered parameters per group only, so two groups produced the same names; the group
    index keeps them unique.
    """
    return f"allreduce.noname.{group_index}.{param_index}"


def find_duplicates(items: Iterable[Hashable]) -> list[Hashable]:
    """The items that occur more than once, in first-seen order."""
    seen: set = set()
    dups: list = []
    for x in items:
        if x in seen and x not in dups:
            dups.append(x)
        seen.add(x)
    return dups


def check_named_parameters(named: Sequence[Any], all_param_ids: set[int]) -> dict[int, str]:
    """Validates `named_parameters` and returns {id(param): name}.

    Args:
        named: the user's `named_parameters` list.
        all_param_ids: ids of every parameter the optimizer updates.

    Raises:
        ValueError: an entry is not a (name, parameter) tuple, names repeat, or a parameter of
            the optimizer has no name.
    """
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    dups = find_duplicates(k for k, _ in named)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(str(d) for d in dups))
    names = {id(v): str(k) for k, v in named}
    unnamed = all_param_ids - set(names)
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         "not named. Python object ids: "
                         + ", ".join(str(i) for i in sorted(unnamed)))
    return names


def split_list(items: Sequence[T], n: int) -> list[list[T]]:
    """Splits `items` into `n` contiguous chunks whose lengths differ by at most one."""
    if n <= 0:
        raise ValueError(f"cannot split into {n} groups; use a positive number")
    n = min(n, len(items)) or 1
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def dumps(obj: Any) -> bytes:
    """Serialises with cloudpickle (lambdas, local classes), falling back to pickle."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is in the torch extra
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return buf.getvalue()


def loads(data: bytes | memoryview) -> Any:
    """Inverse of `dumps`. Only call on bytes received from members of this job."""
    return pickle.loads(data)


def _payload(obj: Any) -> tuple[np.ndarray, int, BaseException | None]:
    """(bytes to send, the size to send, the pickling error). When `obj` cannot be pickled,
    the bytes are the error's text and the size is negative, so that the other ranks take
    part in the same collectives and raise too instead of waiting for ever."""
    try:
        data = dumps(obj)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, raised here
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:4096]
        return np.frombuffer(text, dtype=np.uint8), -len(text), exc
    return np.frombuffer(data, dtype=np.uint8), len(data), None


def broadcast_object(obj: Any, root_rank: int, name: str, process_set: ProcessSet) -> Any:
    """Rank `root_rank`'s `obj` (cloudpickled) on every rank of the process set: its size as
    `<name>.sz`, its bytes as `<name>.t` (every adapter's `broadcast_object`).

    Raises:
        ValueError: the root's object cannot be pickled (on the other ranks; the root raises
            the pickling error itself).
        HorovodInternalError: a broadcast failed.
    """
    is_root = collective.rank() == root_rank
    data, n, exc = _payload(obj) if is_root else (None, 0, None)
    n = int(collective.broadcast(np.array([n], dtype=np.int64), root_rank, name=f"{name}.sz",
                                 process_set=process_set)[0])
    buf = data if is_root else np.zeros(abs(n), dtype=np.uint8)
    out = collective.broadcast(buf, root_rank, name=f"{name}.t", process_set=process_set)
    if n < 0:
        if exc is not None:
            raise exc
        raise ValueError(f"{name}: root rank {root_rank} could not pickle its object "
                         f"({out.tobytes().decode('utf-8', 'replace')}); broadcast only "
                         "picklable objects (no locks, open files or sockets)")
    return obj if is_root else loads(out.tobytes())


def allgather_object(obj: Any, name: str, process_set: ProcessSet) -> list[Any]:
    """Every rank's `obj` (cloudpickled), indexed by rank in the process set: the sizes as
    `<name>.sz`, the bytes as `<name>.t` (every adapter's `allgather_object`).

    Raises:
        ValueError: some rank's object cannot be pickled (on the other ranks, naming them;
            that rank raises its pickling error itself).
        HorovodInternalError: an allgather failed.
    """
    data, n, exc = _payload(obj)
    sizes = collective.allgather(np.array([n], dtype=np.int64), name=f"{name}.sz",
                                 process_set=process_set).tolist()
    raw = collective.allgather(data, name=f"{name}.t", process_set=process_set).tobytes()
    chunks, off = [], 0
    for size in sizes[:process_set_size(process_set)]:
        chunks.append((size, raw[off:off + abs(size)]))
        off += abs(size)
    bad = [(i, c.decode("utf-8", "replace")) for i, (size, c) in enumerate(chunks) if size < 0]
    if bad:
        if exc is not None:
            raise exc
        ranks = process_set.ranks or list(range(len(chunks)))
        raise ValueError(f"{name}: rank(s) {', '.join(str(ranks[i]) for i, _ in bad)} could "
                         f"not pickle their object ({bad[0][1]}); gather only picklable "
                         "objects (no locks, open files or sockets)")
    return [loads(c) for _, c in chunks]


def process_set_size(process_set: ProcessSet = global_process_set) -> int:
    """Size of a process set this rank belongs to (the global set's size is `size()`).

    Raises:
        ValueError: the set is not registered.
    """
    if process_set is global_process_set or process_set.process_set_id == 0:
        return collective.size()
    n = process_set.size()
    if n is None:
        raise not_registered(process_set)
    return n


def not_registered(process_set: ProcessSet) -> ValueError:
    """The error for a query or op on a set that is not registered."""
    return ValueError(f"{process_set} is not registered; pass it to "
                      "hvd.init(process_sets=...) or hvd.add_process_set()")


def process_set_rank(process_set: ProcessSet = global_process_set) -> int:
    """This rank's index inside a process set it belongs to.

    Raises:
        ValueError: the set is unregistered or this rank is not a member ("Process is not part
            of provided process set.", Horovod's text).
    """
    if process_set is global_process_set or process_set.process_set_id == 0:
        return collective.rank()
    r = process_set.rank()
    if r is None:
        raise not_registered(process_set)
    return r


def _user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel, for a warning raised by this function's caller, of the
    nearest frame outside the `frameworks` package: the user's line, however many adapter
    frames (tape, Keras, loss-scale or partial wrappers) lie in between."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    return level


def gradient_reduction(op: Any, gradient_predivide_factor: float, num_groups: int,
                       groups: Any) -> tuple[ReduceOp, Any]:
    """A distributed optimizer's (or gradient tape's) reduce op and groups, after Horovod's
    checks: no Adasum, `gradient_predivide_factor` with Average only, and the deprecated
    `num_groups` standing in for `groups` with Horovod's warning (raised at the user's line).

    Raises:
        NotImplementedError: op=hvd.Adasum.
        ValueError: a predivide factor with an op other than Average.
    """
    op = ReduceOp(int(op))
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("op=hvd.Adasum is not supported by ringvod; use "
                                  "op=hvd.Average (the default) or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=_user_stacklevel())
        if groups is None:
            groups = num_groups
    return op, groups
