"""Elastic training, worker side (framework-neutral): state objects, the retry loop, and the
rendezvous with the elastic driver of `hvdrun` (`launcher/elastic/`).

Horovod's model, kept as is but for the sync agreement (last point):

* The training function is wrapped by `run(func)`; it receives a `State` and commits it every
  few batches (`state.commit()` = `save()` + `check_host_updates()`).
* A failed collective (`HorovodInternalError`: a peer died) makes every survivor `restore()`
  the last commit; a membership change announced by the driver makes rank 0's
  `check_host_updates()` raise `HostsUpdatedInterrupt` on every rank (no restore).
* Either way the wrapper resets: `shutdown()`, a new rendezvous with the driver, `init()`,
  the reset callbacks, `state.sync()` (broadcast from the new rank 0, a worker that holds
  the state: see the protocol below), and the function runs again. An interrupt for hosts
  that were only removed skips the sync, but only when every rank of the new world can:
  before each call of the function the ranks agree (one allreduce) whether any of them needs
  the sync, and then all sync or none does. A new worker always needs it, and so does a
  rank whose collective failed (a peer that dies during `check_host_updates()`' broadcast
  can leave some ranks with the interrupt and others with the failure).
* After a sync every rank saves (the synced state becomes the rollback point everywhere), so
  that a worker that joined has the job's state to roll back to, not its own initial values
  (Horovod's new worker keeps those until the next commit).

Driver protocol (over the job's authenticated key-value store, scope `elastic`):

| key | who writes | value |
|---|---|---|
| `ready.<worker>.<n>` | the worker, at its n-th `init()` | JSON `{"state": true}` once it holds the job's state (below), else `{"state": false}` |
| `assign.<worker>.<n>` | the driver, once every live worker is ready | JSON: rank, size, local/cross ranks, the round's key prefix, the update count, `sync` (the round has a new worker); or `removed` / `stop` with a reason |
| `update.<k>` | the driver, when hosts change | JSON `[timestamp, flags]` (1 removed, 2 added) |
| `alive.<worker>` | the worker, every 5 s from its first `init()` on | empty (the driver keeps only the time) |

A worker holds the job's state once it has entered the training function (`run`): after a
sync, or from the start. A worker that joined and whose first sync failed (a peer died during
it) restored its own initial state; the driver makes a worker that holds the state rank 0 of
the next round, so that the sync never broadcasts a new worker's initial model (and stops the
job when no such worker is left).

`<worker>` is `HOROVOD_ELASTIC_WORKER_ID`, which the driver gives each process it starts. Every
worker follows the `update.<k>` keys with one waiting get on a background thread
(`hvd-elastic-updates`), so `check_host_updates()` costs one small broadcast and no network
round trip to the driver. The `alive.<worker>` heartbeat (thread `hvd-elastic-heartbeat`) tells
the driver that a worker which keeps the others waiting for a new round is busy outside
collectives (a rank-0 checkpoint or evaluation), not stopped or cut off.
"""
from __future__ import annotations

import copy
import functools
import json
import pickle
import queue
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ._log import get_logger
from .config import update_environ
from .errors import (CollectiveTimeoutError, HorovodInternalError, HostsUpdatedInterrupt,
                     MismatchError)

__all__ = ["State", "ObjectState", "run", "run_fn", "reset", "broadcast_object",
           "HostUpdateResult", "rendezvous", "rendezvous_count", "last_reset_timings", "SCOPE",
           "WORKER_ID_ENV"]

SCOPE = "elastic"
WORKER_ID_ENV = "HOROVOD_ELASTIC_WORKER_ID"

# How many times one reset retries its rendezvous when a peer fails during it.
_RESET_ATTEMPTS = 20
# Seconds between two `alive.<worker>` heartbeats.
HEARTBEAT_INTERVAL_S = 5.0


class HostUpdateResult:
    """Flags of a host update (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


# Wall-clock times (time.time()) of the last reset's phases, for benchmarks and logs:
# "error" (the failure or interrupt was caught), "assigned" (the driver answered),
# "initialized" (the new world is up), "callbacks" (the reset callbacks ran), "synced" (the
# state was broadcast from rank 0; the training function is called next).
last_reset_timings: dict[str, float] = {}


# -- rendezvous with the driver ------------------------------------------------------------------
class _Updates:
    """Follows the driver's `update.<k>` keys on a daemon thread; one generation per round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = 0
        self._client: Any = None
        self.queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def restart(self, addr: str, port: int, secret: bytes, first: int) -> None:
        from .rendezvous import KVClient  # noqa: PLC0415

        with self._lock:
            self._gen += 1
            gen = self._gen
            old, self._client = self._client, KVClient(addr, port, secret, timeout=30.0)
            client = self._client
            self.queue = queue.SimpleQueue()
            q = self.queue
        if old is not None:
            old.close()
        threading.Thread(target=self._follow, args=(gen, client, first, q),
                         name="hvd-elastic-updates", daemon=True).start()

    def _follow(self, gen: int, client: Any, k: int, q: "queue.SimpleQueue") -> None:
        while gen == self._gen:
            try:
                raw = client.get(SCOPE, f"update.{k}", timeout=3600.0)
            except CollectiveTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - closed for the next round, or the driver is gone
                return
            if gen != self._gen:
                return
            ts, flags = json.loads(raw)
            q.put((int(ts), int(flags)))
            k += 1

    def drain(self) -> list[tuple[int, int]]:
        out = []
        q = self.queue
        while True:
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                return out


_updates = _Updates()


class _Heartbeat:
    """Puts `alive.<worker>` every `HEARTBEAT_INTERVAL_S` on a daemon thread (one per process,
    started by the first rendezvous), so that the driver can tell a worker that is busy
    outside collectives from one that is stopped, frozen or cut off.

    It beats until the process exits, through `shutdown()` and the end of `run`'s function:
    it tells that the process is alive, not that it trains. A worker that stopped beating
    while others wait for a new round is killed after the straggler timeout and its host
    blacklisted, which a finished worker still writing its checkpoint after `shutdown()` must
    not be; and a later `run` function in the same process gets no new rendezvous to restart
    it. `stop` is for tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: tuple[str, int, bytes, str] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ends the thread (it closes its connection); `start` begins a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join()
        self._stop.clear()

    def start(self, addr: str, port: int, secret: bytes, worker: str) -> None:
        with self._lock:
            self._target = (addr, int(port), secret, worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="hvd-elastic-heartbeat",
                                                daemon=True)
                self._thread.start()

    def _beat(self) -> None:
        from .rendezvous import KVClient  # noqa: PLC0415

        client, where = None, None
        while True:
            with self._lock:
                target = self._target
            assert target is not None
            if client is None or where != target[:3]:
                if client is not None:
                    client.close()
                where = target[:3]
                client = KVClient(target[0], target[1], target[2],
                                  timeout=HEARTBEAT_INTERVAL_S)
            try:
                client.put(SCOPE, f"alive.{target[3]}", b"")
            except Exception:  # noqa: BLE001 - the driver is busy or gone: try again later
                client.close()
                client = None
            if self._stop.wait(HEARTBEAT_INTERVAL_S):
                if client is not None:
                    client.close()
                return


_heartbeat = _Heartbeat()
_inits = 0  # this process's rendezvous requests (the <n> of ready.<worker>.<n>)
# Set by the retry loop when this process first enters the training function: it holds the
# job's state from then on (its rendezvous requests say so, and the driver makes such a worker
# rank 0 of the next round).
_holds_state = False
# Set by `rendezvous` when the driver's round has a worker that was not in the previous one;
# the retry loop clears it before each reset and then syncs the state if it is set.
_round_has_new_worker = False


def rendezvous_count() -> int:
    """This process's requests to the elastic driver so far (`init()` retries only its first)."""
    return _inits


def rendezvous(config: Any) -> tuple[Any, str]:
    """Asks the elastic driver for this process's place in the next world (called by `init()`
    in elastic mode). Updates the `HOROVOD_*` rank variables of this process to match.

    Returns:
        (the config with this round's rank and sizes, the round's rendezvous key prefix).

    Raises:
        SystemExit: the driver removed this worker (code 0) or stopped the job (the reason).
        CollectiveTimeoutError: the driver did not answer within the elastic timeout.
    """
    from .rendezvous import KVClient  # noqa: PLC0415

    global _inits, _round_has_new_worker
    wid = config.elastic_worker_id
    if not wid:
        raise ValueError(f"HOROVOD_ELASTIC=1 but {WORKER_ID_ENV} is not set: start elastic "
                         "jobs with hvdrun --min-np/--host-discovery-script or horovod.run("
                         "min_np=...)")
    n = _inits
    _inits += 1
    secret = bytes.fromhex(config.secret_key) if config.secret_key else b""
    timeout = config.gloo_timeout if config.gloo_timeout > 0 else 30.0
    _heartbeat.start(config.rendezvous_addr, config.rendezvous_port, secret, wid)
    kv = KVClient(config.rendezvous_addr, config.rendezvous_port, secret, timeout)
    try:
        kv.put(SCOPE, f"ready.{wid}.{n}", json.dumps({"state": _holds_state}).encode())
        # The driver may wait up to the elastic timeout for a busy peer to ask too, as long
        # again for --min-np slots, and as long again for the round's new workers to start.
        raw = kv.get(SCOPE, f"assign.{wid}.{n}",
                     timeout=3 * config.elastic_timeout + 2 * timeout + 30.0)
        kv.delete(SCOPE, f"assign.{wid}.{n}")
    finally:
        kv.close()
    msg = json.loads(raw)
    if last_reset_timings:  # a reset (not the first init) is under way
        last_reset_timings["assigned"] = time.time()
    if "removed" in msg:
        sys.stderr.write(f"{msg['removed']}\n")
        sys.stderr.flush()
        raise SystemExit(0)
    if "stop" in msg:
        raise SystemExit(f"hvdrun stopped the elastic job: {msg['stop']}")
    names = {"rank": "HOROVOD_RANK", "size": "HOROVOD_SIZE", "local_rank": "HOROVOD_LOCAL_RANK",
             "local_size": "HOROVOD_LOCAL_SIZE", "cross_rank": "HOROVOD_CROSS_RANK",
             "cross_size": "HOROVOD_CROSS_SIZE"}
    _round_has_new_worker = _round_has_new_worker or bool(msg.get("sync"))
    update_environ({env: str(msg[field]) for field, env in names.items()})
    _updates.restart(config.rendezvous_addr, config.rendezvous_port, secret,
                     int(msg["updates"]))
    return config.replace(**{f: int(msg[f]) for f in names}), str(msg["scope"])


# -- object broadcast ----------------------------------------------------------------------------
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Rank `root_rank`'s `obj` (pickled) on every rank, through two numpy broadcasts.

    Raises:
        HorovodInternalError: the broadcast failed (e.g. a peer died).
    """
    from . import basics, ops  # noqa: PLC0415

    name = name or "elastic.broadcast_object"
    root = basics.rank() == root_rank
    data = pickle.dumps(obj) if root else b""
    n = ops.broadcast(np.array([len(data)], dtype=np.int64), root_rank, name=f"{name}.sz")
    buf = np.frombuffer(data, dtype=np.uint8).copy() if root else np.empty(int(n[0]), np.uint8)
    out = ops.broadcast(buf, root_rank, name=f"{name}.t")
    return obj if root else pickle.loads(out.tobytes())


def _rank() -> int:
    from . import basics  # noqa: PLC0415

    return basics.rank()


# -- state ---------------------------------------------------------------------------------------
class State:
    """The state of an elastic job: what survives a reset, and how to agree on it.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default: numpy broadcast).
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after every reset (e.g. to scale the learning rate by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Queues a host update as if the driver had announced it."""
        _updates.queue.put((int(timestamp), int(update_res)))

    def commit(self) -> None:
        """Saves the state (the point a failure rolls back to), then checks for host updates.

        Raises:
            HostsUpdatedInterrupt: the driver announced a membership change.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises `HostsUpdatedInterrupt` on every rank when rank 0 has seen a host update.

        One broadcast from rank 0, so all ranks decide together.

        Raises:
            HostsUpdatedInterrupt: with `skip_sync=True` when hosts were only removed (the
                retry loop still syncs when any rank of the new world needs it: a new
                worker, or a rank where this broadcast failed).
            HorovodInternalError: the broadcast failed.
        """
        from . import ops  # noqa: PLC0415

        prev = self._last_updated_timestamp
        flags = HostUpdateResult.no_update
        for ts, res in _updates.drain():
            if ts > self._last_updated_timestamp:
                self._last_updated_timestamp = ts
                flags |= res
        words = ops.broadcast(np.array([prev, self._last_updated_timestamp, flags], np.int64),
                              0, name="elastic.check_host_updates")
        prev, last, flags = (int(x) for x in words)
        self._last_updated_timestamp = last
        if last > prev:
            raise HostsUpdatedInterrupt(flags == HostUpdateResult.removed)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Hook run after every reset, before the callbacks."""


class ObjectState(State):
    """State of plain attributes: `ObjectState(epoch=0, batch=0)` gives `state.epoch`, ...

    `save()` snapshots the attributes (deep copies, so later in-place changes do not leak into
    the snapshot), `restore()` puts the snapshot back, `sync()` broadcasts rank 0's snapshot
    and rank 0's current values. The current values matter after a `HostsUpdatedInterrupt`
    raised between commits (by `check_host_updates()`): nothing is restored then, and the
    model and optimizer are synced as they are, so the attributes (`batch`, `epoch`, ...) must
    keep their uncommitted values too. Horovod broadcasts the snapshot only, which puts the
    attributes back to the last commit but leaves the model where it was.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            current = {k: getattr(self, k) for k in self._saved_state}
            saved, current = self._bcast_object((self._saved_state, current))
            self._saved_state = copy.deepcopy(saved)
            for k, v in current.items():
                setattr(self, k, copy.deepcopy(v))

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


# -- the retry loop ------------------------------------------------------------------------------
def reset() -> None:
    """Shuts the runtime down and joins the next world (`shutdown()`, rendezvous, `init()`).

    In an elastic job, a peer that fails during the rendezvous makes it start over (up to 20
    times): the driver forms the next world without it. A job that is not elastic (no driver:
    hvdrun without --min-np, mpirun, torchrun) re-forms the same ranks, so a peer that is gone
    stays gone and the first failure is raised.

    Raises:
        HorovodInternalError: the rendezvous kept failing (at once, in a job not elastic).
        SystemExit: the driver removed this worker or stopped the job.
    """
    from . import basics  # noqa: PLC0415

    log = get_logger()
    for attempt in range(_RESET_ATTEMPTS):
        basics.shutdown()
        try:
            basics.init()
            last_reset_timings["initialized"] = time.time()
            return
        except HorovodInternalError as exc:
            # _inits counts this process's requests to the elastic driver: none, no driver.
            if attempt + 1 == _RESET_ATTEMPTS or _inits == 0:
                raise
            log.warning("elastic: the rendezvous failed (%s); trying again", exc)


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wraps `func(state, ...)` in Horovod's elastic retry loop with the given `reset`."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        global _round_has_new_worker, _holds_state
        skip_sync = False
        synced_once = False
        while True:
            try:
                # All ranks sync or none: a rank's own reason may not be the others'.
                if _sync_needed(not skip_sync or _round_has_new_worker):
                    state.sync()
                    # The synced state is every rank's rollback point. A new worker's own
                    # snapshot is its initial values, not the job's: if the ranks of the old
                    # world died before the next commit, it would be the new rank 0 and restore
                    # and broadcast its initial model next to the job's committed attributes.
                    state.save()
                if synced_once:
                    last_reset_timings["synced"] = time.time()
                synced_once = True
                # Synced (every first entry syncs): this rank holds the job's state now.
                _holds_state = True
                return func(state, *args, **kwargs)
            except MismatchError:
                # The ranks submitted different tensors under one name: a bug of the script,
                # which a new world would meet again at the same step (restarting forever).
                # Rank 0 reports it to every rank of the set, so all of them leave here.
                raise
            except HorovodInternalError as exc:
                last_reset_timings.clear()
                last_reset_timings["error"] = time.time()
                get_logger().warning("elastic: a collective failed (%s); restoring the last "
                                     "commit and re-forming the ring", _first_line(exc))
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                last_reset_timings.clear()
                last_reset_timings["error"] = time.time()
                skip_sync = exc.skip_sync
            _round_has_new_worker = False
            reset()
            state.on_reset()
            last_reset_timings["callbacks"] = time.time()

    return wrapper


def _sync_needed(need: bool) -> bool:
    """Whether any rank needs `state.sync()`: one allreduce (MAX) of every rank's `need`.

    Each entry into the training function (the first, and after every reset) runs it on every
    rank of the world, so the ranks cannot split between syncing and training. They can
    disagree locally: a peer that dies during `check_host_updates()`' broadcast leaves some
    ranks with `HostsUpdatedInterrupt(skip_sync=True)` and others with `HorovodInternalError`
    (restore, so sync); a new worker always syncs.

    Raises:
        HorovodInternalError: the allreduce failed (e.g. a peer died).
    """
    from . import ops  # noqa: PLC0415
    from .types import ReduceOp  # noqa: PLC0415

    flags = ops.allreduce(np.array([int(need)], np.int64), op=ReduceOp.MAX,
                          name="elastic.sync_needed")
    return bool(flags[0])


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of an elastic training function `func(state, *args, **kwargs)`.

    Call no collective before it; commit the state every few batches. Example::

        @hvd.elastic.run
        def train(state):
            while state.epoch < epochs:
                ...                  # one epoch, committing every few batches
                state.epoch += 1
                state.commit()

        train(hvd.elastic.ObjectState(epoch=0))
    """
    return run_fn(func, reset)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
