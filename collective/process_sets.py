"""`ProcessSet`: a sorted subset of global ranks with its own negotiation and communicators."""
from __future__ import annotations

from typing import Any, Sequence

from ._current import current_or_none
from .errors import NotInitializedError

__all__ = ["ProcessSet", "global_process_set"]


class ProcessSet:
    """A group of ranks that runs collectives among themselves.

    Attributes:
        process_set_id: id assigned at registration (0 = all ranks); None before, and again
            after `shutdown()` or `remove_process_set()` (pass the set to the next `init()`,
            or add it again, to register it afresh).
        ranks: sorted global ranks.
        mpi_comm: the mpi4py communicator it was built from, if any.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] | None = None  # resolved at registration
        else:
            ranks = sorted(int(r) for r in ranks_or_comm)
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"process set ranks must be unique, got {list(ranks_or_comm)}")
            self.ranks = ranks
        self.process_set_id: int | None = None
        self._runtime: Any = None  # set at registration

    def _bind(self, ps_id: int, ranks: list[int], runtime: Any) -> None:
        self.process_set_id, self.ranks, self._runtime = ps_id, ranks, runtime

    def _invalidate(self) -> None:
        self.process_set_id, self._runtime = None, None

    def size(self) -> int | None:
        """Number of ranks, or None while the set is not registered."""
        return None if self.ranks is None or self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank inside the set, or None while the set is not registered.

        Raises:
            ValueError: this process is not a member of the set (Horovod's text).
        """
        if self._runtime is None or self.ranks is None or self.process_set_id is None:
            return None
        me = self._runtime.rank
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is one of `ranks`, registered or not (as Horovod); None while
        the ranks are unknown (a set built from an mpi4py communicator, before registration).

        Raises:
            NotInitializedError (a ValueError): not initialised (Horovod's text).
        """
        if self.ranks is None:
            return None
        rt = self._runtime if self._runtime is not None else current_or_none()
        if rt is None:
            raise NotInitializedError()
        return rt.rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and (
            self.process_set_id == other.process_set_id)

    def __hash__(self) -> int:
        # The ranks only: the id changes when the set is registered, removed or unbound at
        # shutdown, and a set used as a dict key must stay found (equal sets have equal ranks).
        return hash(tuple(self.ranks or ()))

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__

    # A set is registered with the running job, which a copy cannot be: a deep copy of a model
    # holding one (SyncBatchNorm's) keeps using the same set, and an unpickled one is the set
    # registered under its id with the same ranks where there is one (torch.save and
    # torch.load in the same job), else an unregistered set of those ranks.
    def __copy__(self) -> "ProcessSet":
        return self

    def __deepcopy__(self, memo: dict) -> "ProcessSet":
        return self

    def __reduce__(self) -> tuple:
        if self.ranks is None:
            raise TypeError(f"{self} cannot be pickled: it was built from an mpi4py "
                            "communicator and is not registered (its ranks are not known yet)")
        return _restore, (list(self.ranks), self.process_set_id)


class _GlobalProcessSet(ProcessSet):
    """Process set 0: all ranks. It follows the current runtime: before `init()` (and after
    `shutdown()`) `ranks` is None and `size()`, `rank()` and `included()` raise
    `NotInitializedError` (a ValueError, as Horovod's); once initialised, `ranks` lists every
    rank, as Horovod's `global_process_set.ranks` does."""

    def __init__(self) -> None:
        # Not ProcessSet.__init__: `ranks` is a property here, not a stored list.
        self.mpi_comm = None
        self.process_set_id = 0
        self._runtime = None

    @property  # type: ignore[override]  # read-only: the job's ranks, or None
    def ranks(self) -> list[int] | None:
        rt = current_or_none()
        return None if rt is None else list(range(rt.size))

    def __hash__(self) -> int:  # one value whether or not initialised (a dict key stays found)
        return hash(((), 0))

    def __reduce__(self) -> str:  # the one global set, also when unpickled
        return "global_process_set"

    # Horovod answers these for the global set once initialised (all ranks are members), and
    # raises before.
    def size(self) -> int:
        return _initialised().size

    def rank(self) -> int:
        return _initialised().rank

    def included(self) -> bool:
        _initialised()
        return True


def _restore(ranks: list[int], ps_id: int | None) -> ProcessSet:
    """An unpickled process set (`ProcessSet.__reduce__`)."""
    rt = current_or_none()
    if rt is not None and ps_id is not None:
        try:
            registered = rt.registered_set(ps_id)
        except ValueError:  # no set of that id in this job
            registered = None
        if registered is not None and registered.ranks == ranks:
            return registered
    return ProcessSet(ranks)


def _initialised() -> Any:
    rt = current_or_none()
    if rt is None:
        raise NotInitializedError()
    return rt


global_process_set = _GlobalProcessSet()
