"""Gradient sets: a fixed list of tensors allreduced every step, one op per member as in
Horovod's per-gradient mode, without a request, table entry and handle per member and step.

`DistributedOptimizer` without buckets (`HOROVOD_BUCKET_CAP_MB=0`) reduces each gradient as
soon as backward produces it, and the coordinator fuses whatever is ready on every rank. Through
the ordinary op path each gradient of each step costs a request, a tensor-table entry, a handle,
a cache lookup, a ready event and a stream wait, most of it while backward's own kernel launches
wait for the GIL. A gradient set moves that work out of the step:

* **registration** (`register`, once per optimizer and runtime; collective): every rank
  allgathers a fingerprint per member (name, shape, dtype, reduce op, scaling), so a different
  model on some rank fails here with the member and the ranks named, never later as a hang.
  The set becomes part of its process set's negotiation at the point where that allgather
  completes, which is the same round on every rank;
* **submit** (a gradient hook): stores the tensor, appends the member's index to a deque and
  nudges the coordinator; nothing else;
* **negotiation** (collective/coordinator/negotiate.py): each set adds one bit per member to the
  round's AND vector, after the response cache's bits. Members set on every rank are agreed;
  every rank cuts them, in member order, into fused ops of up to the fusion threshold (the
  same rules as `fusion.plan_fusion`: one dtype per op), so no rank-0 plan travels;
* **execution** (collective/coordinator/execute.py): an agreed chunk runs on the engine like a
  fused response, in place; a device member's ready event (recorded by its hook) orders the
  engine's stream after the kernels that produced it;
* **wait** (the optimizer's `synchronize`): blocks until every member of the step has run and
  returns the last op's completion; the caller's stream waits on that one event.

A rank that joined (`hvd.join()`) contributes zeros: its bits are all set, and it runs every
agreed chunk with zero tensors, except for members it submitted before it joined (in the
middle of a step), which it sends as submitted and counts for its step. `join()` covers the
global process set only, so a set of another process set cannot run while a member waits in
the global `join()`: that member also sets all its bits, and the members the others submitted
fail on every member instead (`fail_joined`). Members submitted here but not by every rank after
`HOROVOD_STALL_CHECK_TIME_SECONDS` are named in a warning on this rank; after
`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (when set) this rank also names them in an error and
asks for the job to shut down (`stalled`), which its next global round tells every rank.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from . import _current, _log
from .engines.device import release_events
from .entry import Entry, default_allocate
from .errors import MismatchError
from .handle import Handle
from .negotiation import bit_indices, words_to_int
from .types import CPU_DEVICE, DataType, ReduceOp, Request, RequestType, Response, ResponseType
from .wire import quote_name

__all__ = ["GradientSet", "SetChunk", "register", "MISMATCH", "JOINED"]

_log_ = _log.get_logger()

MISMATCH = ("DistributedOptimizer's gradients differ across ranks: {detail}. Every rank must "
            "wrap the same model's parameters, in the same order, with the same names, dtypes "
            "and options (named_parameters, op, gradient_predivide_factor, compression).")

JOINED = ("The DistributedOptimizer's allreduce of gradient(s) {names} on process set {ps} "
          "(ranks {ranks}) cannot complete: rank(s) {joined} called hvd.join() and wait there "
          "without submitting them (rank(s) {sent} submitted them). join() covers the global "
          "process set only: joined ranks contribute zeros to allreduces of the global process "
          "set and take no part in ops of other process sets. Finish the optimizer's steps on "
          "process set {ps} on every member before calling hvd.join(), or wrap the optimizer "
          "on the global process set.")


class SetChunk:
    """Agreed members of one gradient set that run as one (fused) allreduce."""

    __slots__ = ("gset", "indices", "joined", "own")

    def __init__(self, gset: "GradientSet", indices: list[int], joined: bool,
                 own: int = 0) -> None:
        self.gset = gset
        self.indices = indices
        self.joined = joined  # this rank joined: contribute zeros...
        self.own = own  # ...except for these members (bit mask), submitted before it joined

    def response(self) -> Response:
        s, idx = self.gset, self.indices
        return Response(ResponseType.ALLREDUCE, [s.names[i] for i in idx],
                        s.dtypes[idx[0]], s.device, [s.sizes[i] for i in idx], s.op,
                        s.prescale, s.postscale, shapes=[s.shapes[i] for i in idx])


class GradientSet:
    """One registered list of tensors (see the module docstring). User threads call `submit`
    and `wait`; the coordinator calls the rest once the set is in its process set's `sets`."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 dtypes: Sequence[DataType], device: int, op: ReduceOp, prescale: float,
                 postscale: float, stall_time: float,
                 allocate: Callable[[tuple, Any], Any] | None = None,
                 shutdown_time: float = 0.0) -> None:
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.device = device
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.nbytes = [n * d.itemsize for n, d in zip(self.sizes, self.dtypes)]
        self.n = len(self.names)
        self.nwords = (self.n + 63) // 64
        self.full = (1 << self.n) - 1
        self.stall_time = stall_time
        self.shutdown_time = shutdown_time  # 0: a stall never shuts the job down
        self.stalled = False  # a member waited past shutdown_time: the job must shut down
        self.allocate = allocate or default_allocate  # the engine's fusion buffer comes from it
        # Dropped by its owner mid-step: no part in later agreements; once retired on every
        # rank it leaves the rounds (`ProcessSetState.set_flags`).
        self.retired = False
        self._sent_retired = False  # `retired` as this round's bits were sent (coordinator)
        self.runtime: Any = None  # the runtime it is registered with
        self.wake: Callable[[bool], None] | None = None  # the coordinator's wake(held)
        self.waiting: Callable[[int], None] | None = None  # the coordinator's waiting(delta)
        # Shared with user threads:
        self.tensors: list[Any] = [None] * self.n  # this step's engine views
        self.ready: list[Any] = [None] * self.n  # ready events of device members
        self._new: deque[int] = deque()  # submitted, not yet taken into a round
        self.new_bytes = 0
        self._submitted = 0  # bit mask of this step's submits (user side)
        self._left = self.n  # members not yet run this step (coordinator side)
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.completion: Any = None  # the last op's completion (device: a DeviceResult)
        # Coordinator only:
        self.mask = 0  # submitted on this rank, not yet agreed
        self._since = 0.0  # when the oldest pending member was submitted
        self._warned = False

    # -- user side ------------------------------------------------------------------------------
    def submit(self, i: int, tensor: Any, ready: Any = None) -> None:
        """Member `i`'s tensor for this step (an engine view: numpy array or device buffer)
        and, for a device member, its ready event (as `Entry.ready_event`). Any thread; once
        per member and step.

        Raises:
            ValueError: member `i` was already submitted this step.
        """
        bit = 1 << i
        if self._submitted & bit:
            raise ValueError(f"gradient {self.names[i]!r} was submitted twice in one step")
        self._submitted |= bit
        self.tensors[i] = tensor
        self.ready[i] = ready
        self._new.append(i)
        self.new_bytes += self.nbytes[i]
        wake = self.wake
        if wake is not None:
            wake(self.device != CPU_DEVICE)

    def wait(self) -> Any:
        """Blocks until every member of this step has run; returns the last op's completion
        (None for host sets) and starts the next step.

        Raises:
            HorovodInternalError / ShutdownError: an op failed, or the job ended.
        """
        if not self._done.is_set() and self.error is None:
            waiting = self.waiting
            if waiting is not None:
                waiting(1)  # the coordinator negotiates at once instead of collecting
            try:
                self._done.wait()
            finally:
                if waiting is not None:
                    waiting(-1)
        if self.error is not None:
            raise self.error
        done = self.completion
        self.tensors = [None] * self.n
        self.ready = [None] * self.n
        self.completion = None
        self._submitted = 0
        self._left = self.n
        self._done.clear()
        return done

    def current(self) -> bool:
        """Registered with the runtime this thread's ops go to (not one shut down and
        replaced by a later `init()`)."""
        return self.runtime is not None and _current.current_or_none() is self.runtime

    def partial(self) -> bool:
        """Some members were submitted this step and `wait` has not returned (user side)."""
        return bool(self._submitted)

    def retire(self) -> None:
        """Drops the set mid-step (its owner reset): from the next round on its bits are 0 on
        this rank, so its pending members never run; a new set takes its place."""
        self.retired = True

    def fail(self, exc: BaseException) -> None:
        """Fails the current and every later `wait` (the job ended or an op failed)."""
        if self.error is None:
            self.error = exc
        self._done.set()

    # -- coordinator side -----------------------------------------------------------------------
    def busy(self) -> bool:
        """Members submitted on this rank and not yet run."""
        return not self.retired and bool(self.mask or self._new)

    def take(self, now: float, tl: Any = None) -> None:
        """Moves this step's new submits into the pending mask (start of a round)."""
        new = self._new
        if self.retired:
            self.drop(tl)
            return
        if new:
            if not self.mask:
                self._since = now
            mask = self.mask
            while new:
                i = new.popleft()
                mask |= 1 << i
                if tl is not None:
                    tl.negotiate_start(self.names[i], "ALLREDUCE")
            self.mask = mask
            self.new_bytes = 0

    def _check_stall(self, now: float) -> None:
        """After a round that agreed none of this rank's pending members: names them in a
        warning once they have waited HOROVOD_STALL_CHECK_TIME_SECONDS, and asks for the job to
        shut down once they have waited HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (`stalled`; the
        coordinator's next global round tells every rank)."""
        age = now - self._since
        if not self._warned and age > self.stall_time:
            self._warned = True
            _log_.warning(
                "One or more ranks did not submit gradients that this rank submitted %.0f s "
                "ago: %s. Every rank must call backward() and optimizer.step() (or "
                "synchronize()) the same number of times; a rank that runs out of data should "
                "call hvd.join().", age, self._pending_names())
        if self.shutdown_time > 0 and not self.stalled and age >= self.shutdown_time:
            self.stalled = True
            _log_.error(
                "Gradients submitted on this rank have waited %.1f s for other ranks, "
                "reaching HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (%g s): %s. Will shutdown.", age,
                self.shutdown_time, self._pending_names())

    def _pending_names(self) -> str:
        names = [self.names[i] for i in bit_indices(self.mask)]
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    def drop(self, tl: Any = None) -> None:
        """Forgets this step's submits of a retired set and gives back their ready events
        (coordinator: each round's `take`, and where the set leaves the rounds); the timeline's
        negotiations of its pending members end (`tl`, rank 0's)."""
        if tl is not None:
            for i in bit_indices(self.mask):
                tl.negotiate_end(self.names[i])
        self._new.clear()
        self.new_bytes = 0  # or the loop's fusion window keeps waking for it
        self.mask = 0
        self.tensors = [None] * self.n
        ready, self.ready = self.ready, [None] * self.n
        release_events(ready)

    def words(self, joined: bool) -> np.ndarray:
        """This rank's bits for a round: its pending members (all members once it joined)."""
        # `retired` may change while the round is in flight (the owner resets on its thread):
        # the agreement must follow what this round sent.
        self._sent_retired = retired = self.retired
        mask = 0 if retired else self.full if joined else self.mask
        return np.frombuffer(mask.to_bytes(8 * self.nwords, "little"), dtype="<u8")

    def agree(self, res: np.ndarray, joined: bool, threshold: int) -> list[SetChunk]:
        """The members set in the round's AND result `res` (this set's words), cut into fused
        ops in member order; they leave the pending mask."""
        common = words_to_int(res)
        common &= self.full if joined else self.mask
        if self._sent_retired:
            return []
        if not common:
            if self.mask and self.stall_time > 0:
                self._check_stall(time.monotonic())
            return []
        # A rank that joined in the middle of a step still sends the members it submitted
        # before, as an ordinary op's entry is sent (zeros only where it has none).
        own = common & self.mask
        if own:
            self.mask &= ~own
            self._warned = False
            if self.mask:
                self._since = time.monotonic()
        return [SetChunk(self, idx, joined, own)
                for idx in self._cut(bit_indices(common), threshold)]

    def fail_joined(self, res: np.ndarray, joined: bool, ps: Any) -> list[int] | None:
        """While members of this set's process set `ps` (a `ProcessSetState`, not the global
        set's) wait in the global `join()` (`ps.members_joined`), where they sent all their bits
        (`joined` here): if the round's AND `res` has members, the other members submitted them,
        and they can never run. Then they fail on every member alike (`JOINED`; logged where
        this rank is a joined one) and the set is retired everywhere in the same round (its
        owner registers a new one at its next step). Returns this rank's pending members that
        failed (empty on a joined rank), None when nothing failed."""
        common = words_to_int(res) & (self.full if joined else self.mask)
        if self._sent_retired or not common:
            return None
        failed = bit_indices(self.mask)
        names = [quote_name(self.names[i]) for i in bit_indices(common)]
        ranks, away = ps.ranks, ps.members_joined
        exc = MismatchError(JOINED.format(
            names=", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5
                                          else ""),
            ps=ps.id, ranks=list(ranks), joined=", ".join(str(ranks[i]) for i in sorted(away)),
            sent=", ".join(str(r) for i, r in enumerate(ranks) if i not in away)))
        if joined:
            _log_.error("Rank %d waits in hvd.join() while other ranks of process set %d "
                        "stepped a DistributedOptimizer that includes it; they fail there: %s",
                        ranks[ps.rank], ps.id, exc)
        self.mask = 0
        self.retire()
        self.fail(exc)
        return failed

    def _cut(self, members: list[int], threshold: int) -> list[list[int]]:
        chunks: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = 0
        dtype = None
        for i in members:
            nb = self.nbytes[i]
            if cur and (self.dtypes[i] != dtype or cur_bytes + nb > threshold):
                chunks.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nb
            dtype = self.dtypes[i]
        if cur:
            chunks.append(cur)
        return chunks

    def entries(self, chunk: SetChunk, engine: Any, handle: Handle) -> list[Entry]:
        """The engine entries of a chunk: in-place ops on this step's tensors (zeros on a
        rank that joined)."""
        out = []
        joined, own = chunk.joined, chunk.own
        for i in chunk.indices:
            zeros = joined and not own >> i & 1
            if zeros:
                t, ev = engine.zeros(self.shapes[i], self.dtypes[i], self.device), None
            else:
                # The engine gives the event back to its pool once it waited on it: forget it
                # here, so that a retired set does not give it back a second time.
                t, ev = self.tensors[i], self.ready[i]
                self.ready[i] = None
            req = Request(0, RequestType.ALLREDUCE, self.names[i], self.dtypes[i],
                          self.shapes[i], self.device, -1, self.op, self.prescale,
                          self.postscale)
            # A joined rank's zeros are the engine's own arrays: its default allocator.
            out.append(Entry(req, t, handle, t, default_allocate if zeros else self.allocate,
                             ready_event=ev))
        return out

    def ran(self, chunk: SetChunk, completion: Any) -> None:
        """A chunk was launched (coordinator)."""
        n = len(chunk.indices)
        if chunk.joined:  # only the members this rank submitted count for its step
            n = sum(chunk.own >> i & 1 for i in chunk.indices)
            if not n:
                return
        self.completion = completion
        self._left -= n
        if self._left <= 0:
            self._done.set()


def _fingerprint(name: str, shape: tuple[int, ...], dtype: DataType, device: bool,
                 op: ReduceOp, prescale: float, postscale: float) -> int:
    text = f"{name}|{shape}|{dtype.name}|{device}|{int(op)}|{prescale!r}|{postscale!r}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def register(names: Sequence[str], shapes: Sequence[tuple[int, ...]],
             dtypes: Sequence[DataType], device: int, process_set: Any, op: ReduceOp,
             prescale: float, postscale: float,
             allocate: Callable[[tuple, Any], Any] | None = None) -> GradientSet | None:
    """Registers a gradient set with the running job (collective over `process_set`: every
    member rank calls it at the same point of its op sequence). `allocate`: as
    `Entry.allocate`, for the engine's buffers (the framework's allocator). None when the job
    cannot run one (not initialised, dynamic process sets): the caller then submits ordinary
    ops.

    Raises:
        ValueError: the members differ across ranks (names, shapes, dtypes, op, scaling).
        HorovodInternalError / ShutdownError: the job failed or ended.
    """
    rt: Any = _current.current()
    if rt.shut_down:
        from .coordinator.state import shutdown_error  # the coordinator imports this module
        raise shutdown_error(rt.cause, rt.shut_down_by)
    if rt.dynamic_process_sets:
        return None
    state = rt.process_set_state(process_set, "DistributedOptimizer")
    cfg = rt.config
    warn = 0.0 if cfg.stall_check_disable else cfg.stall_check_time
    # As the stall inspector: no shutdown without warnings, or below the warning time.
    stop = cfg.stall_shutdown_time if warn > 0 and cfg.stall_shutdown_time >= warn else 0.0
    gset = GradientSet(names, shapes, dtypes, device, op, prescale, postscale, warn, allocate,
                       shutdown_time=stop)
    gset.runtime = rt
    coord = rt.coordinator
    gset.wake = coord.wake
    gset.waiting = coord.waiting
    prints = np.array([len(gset.names)] + [
        _fingerprint(n, s, d, device != CPU_DEVICE, op, prescale, postscale)
        for n, s, d in zip(gset.names, gset.shapes, gset.dtypes)], dtype=np.uint64)
    # Numbered by the registrations completed so far, which every rank counts alike (an attempt
    # that fails, e.g. while a rank is joined, counts nowhere).
    name = f"ringvod.gradient_set.{state.set_count + 1}"
    req = Request(state.rank, RequestType.ALLGATHER, name, DataType.INT64, prints.shape)
    entry = Entry(req, prints.view(np.int64), Handle(name))
    verdict: list[str] = []
    checked = threading.Event()

    def activate(h: Handle) -> None:
        # Runs where the allgather completes: inside the same round on every rank, so every
        # rank adds the set's bits to the same next round.
        try:
            if h.exception() is not None:
                return
            problem = _compare(np.asarray(h._result).view(np.uint64), prints, gset.names,
                               state.ranks, state.rank)
            state.set_count += 1  # completed on every rank (as a failure, with a problem)
            if problem:
                verdict.append(problem)
            else:
                state.sets.append(gset)
        finally:
            checked.set()

    entry.handle.add_done_callback(activate)
    rt.submit(state, [entry])
    entry.handle.wait()
    # The handle lets its waiter go before its callbacks run: wait for the check.
    checked.wait()
    if verdict:
        raise ValueError(MISMATCH.format(detail=verdict[0]))
    return gset


def _compare(gathered: np.ndarray, mine: np.ndarray, names: list[str], ranks: list[int],
             me: int) -> str:
    """'' when every rank registered the same members, else what differs."""
    blocks, pos = [], 0
    for _ in ranks:
        n = int(gathered[pos])
        blocks.append(gathered[pos + 1:pos + 1 + n])
        pos += 1 + n
    ref = blocks[0]
    for r, b in enumerate(blocks):
        if len(b) != len(ref):
            return (f"rank {ranks[0]} has {len(ref)} parameters with gradients, rank "
                    f"{ranks[r]} has {len(b)}")
    for i in range(len(ref)):
        differ = [ranks[r] for r, b in enumerate(blocks) if b[i] != ref[i]]
        if differ:
            return (f"parameter {i} ({quote_name(names[i])} on rank {ranks[me]}) has a different "
                    f"name, shape, dtype or option on rank(s) {differ} than on rank {ranks[0]}")
    return ""
