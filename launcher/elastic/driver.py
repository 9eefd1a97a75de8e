"""The elastic driver: starts workers as hosts come and go, re-forms the world after failures.

One thread (the caller of `ElasticDriver.run`) owns all state and handles events from a queue:

| event | from | what happens |
|---|---|---|
| `ready` | the key-value server (a worker's `init()` put `ready.<worker>.<n>`) | once every live worker is ready, a new round is formed |
| `exit` | the spawner | a failure blacklists the worker's host; the barrier may now be complete |
| `hosts` | the discovery thread (every second) | a change that alters the assignment is announced to the workers (`update.<k>`), flagged added and/or removed by comparing each host's slots with the previous discovery |
| `signal` | SIGINT/SIGTERM/SIGHUP | the job stops |

Forming a round (Horovod's `_on_workers_recorded` + `resume`): count the reset (and stop past
`--reset-limit`), wait for at least `--min-np` slots (up to `--elastic-timeout`), then assign
ranks with the surviving workers first and a worker that holds the job's state (its
`ready.<worker>.<n>` says so: it has entered the training function) at rank 0, whose state is
broadcast: a worker that joined and whose first sync failed holds its initial state only (and
with no holder left, the job stops), answer every waiting worker with its place and the
round's rendezvous key prefix, and start workers for new slots. A new worker syncs the state
from rank 0 before it trains, so when a round starts one, every answer says `sync` and the
survivors sync too, whatever the update flags said (the assignment can change between the
announcement and the round). Every answer goes through the job's authenticated key-value
store.
"""
from __future__ import annotations

import json
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

from collective.rendezvous import KVServer

from .._proc import catch_signals, describe_exit
from ..hosts import HostInfo, SlotInfo, get_host_assignments
from .discovery import DiscoveryError, FixedHosts, HostDiscovery, HostManager, as_discovery
from .spawn import WorkerSpawner

__all__ = ["ElasticDriver", "ElasticKVServer", "ElasticResult", "assign_slots",
           "host_update_flags", "ready_holds_state", "RESET_LIMIT_MESSAGE",
           "DISCOVERY_INTERVAL_S"]

DISCOVERY_INTERVAL_S = 1.0
# The workers' `alive.<worker>` heartbeat period (collective.elastic.HEARTBEAT_INTERVAL_S).
HEARTBEAT_INTERVAL_S = 5.0

# The worker side of the protocol is collective/elastic.py (which the launcher does not import:
# it needs numpy); tests/unit/test_elastic_driver.py checks that both agree.
SCOPE = "elastic"
WORKER_ID_ENV = "HOROVOD_ELASTIC_WORKER_ID"


class HostUpdateResult:
    no_update, removed, added, mixed = 0, 1, 2, 3
GRACE_PERIOD_S = 5.0
RESET_LIMIT_MESSAGE = ("Horovod was shutdown because number of resets during elastic job "
                       "exceeded limit: {}")


def _number(text: str) -> bool:
    """An unsigned decimal in ASCII digits (str.isdigit alone accepts '²', which int refuses)."""
    return text.isascii() and text.isdigit()


class ElasticKVServer(KVServer):
    """The job's key-value server; it tells the driver when a worker asks for its place."""

    def __init__(self, *args: Any, on_ready: Callable[[int, int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_ready = on_ready
        self._beats: dict[int, float] = {}

    def heartbeats(self) -> dict[int, float]:
        """Worker id -> time.monotonic() of its latest `alive.<worker>` heartbeat."""
        return dict(self._beats)

    def put(self, scope: str, key: str, value: bytes) -> None:
        if scope == SCOPE and key.startswith("alive."):
            wid = key[len("alive."):]
            if _number(wid):
                self._beats[int(wid)] = time.monotonic()
            return  # only the time matters: nothing to store
        super().put(scope, key, value)
        if scope == SCOPE and key.startswith("ready."):
            parts = key.split(".")
            if len(parts) == 3 and _number(parts[1]) and _number(parts[2]):
                self._on_ready(int(parts[1]), int(parts[2]))


@dataclass
class _Worker:
    id: int
    host: str
    rank: int = -1
    ready_seq: int = -1     # the n of its latest ready.<id>.<n>
    answered_seq: int = -1  # the n of the latest assign.<id>.<n> the driver wrote
    exit: tuple[int, str | None] | None = None
    removed: bool = False
    failed: bool = False
    round: int = 0          # the last round it was placed in
    holds_state: bool = False  # its ready said so: it has entered the training function

    @property
    def live(self) -> bool:
        return self.exit is None and not self.removed

    @property
    def waiting(self) -> bool:
        return self.ready_seq > self.answered_seq


@dataclass
class ElasticResult:
    """How an elastic job ended; `exit_code` 0 means the last workers all exited 0."""

    exit_code: int
    summary: str
    error: str | None = None
    final_size: int = 0
    resets: int = 0
    results_ranks: list[int] = field(default_factory=list)


def assign_slots(hosts: list[HostInfo], survivors: list[tuple[int, str, int]],
                 max_np: int | None, holders: Collection[int] = ()
                 ) -> tuple[list[SlotInfo], dict[int, SlotInfo], list[SlotInfo], list[int]]:
    """Places survivors first, then new workers, on the available hosts (pure).

    Args:
        hosts: available hosts, oldest first.
        survivors: (worker id, host, previous rank) of the workers that stay if they can.
        max_np: the most workers (None: as many as there are slots).
        holders: ids of the survivors that hold the job's state (they have entered the
            training function: synced it, or trained from the start). The others joined in
            the previous round and their first sync failed: they hold their initial state
            only, and must not be rank 0, whose state every rank receives.

    Returns:
        (all slots by rank, survivor id -> slot, slots for new workers, ids of survivors that
        have no place any more). Hosts with a holder come first, then hosts with other
        survivors, then the rest, each group in host order; on each host the holders take
        the lowest local ranks, then the other survivors, each in their previous order. So
        rank 0 is the lowest-ranked holder of the oldest host that has one, whenever a
        holder has a place (holders are kept before other survivors); without holders (none
        reported, as at the start), the lowest-ranked survivor of the oldest host with one.
    """
    slots_of = {h.hostname: h.slots for h in hosts}
    cap = sum(slots_of.values()) if max_np is None else min(max_np, sum(slots_of.values()))
    holding = set(holders)
    staying: dict[str, list[tuple[int, int]]] = {}
    removed: list[int] = []
    kept = 0
    for wid, host, prev in sorted(survivors, key=lambda s: (s[0] not in holding, s[2])):
        if host in slots_of and len(staying.get(host, [])) < slots_of[host] and kept < cap:
            staying.setdefault(host, []).append((prev, wid))
            kept += 1
        else:
            removed.append(wid)

    def group(host: str) -> int:
        if any(wid in holding for _, wid in staying.get(host, ())):
            return 0
        return 1 if host in staying else 2

    order = sorted((h.hostname for h in hosts), key=group)  # stable: host order within groups
    counts = {h: len(staying.get(h, [])) for h in order}
    free = cap - kept
    for h in order:
        extra = min(slots_of[h] - counts[h], free)
        counts[h] += extra
        free -= extra
    plan = [HostInfo(h, counts[h]) for h in order if counts[h] > 0]
    total = sum(counts.values())
    slots = get_host_assignments(plan, total) if total else []
    placed: dict[int, SlotInfo] = {}
    new: list[SlotInfo] = []
    for s in slots:
        mine = staying.get(s.hostname, [])
        if s.local_rank < len(mine):
            placed[mine[s.local_rank][1]] = s
        else:
            new.append(s)
    return slots, placed, new, removed


def ready_holds_state(value: bytes | None) -> bool:
    """Whether a worker's `ready.<worker>.<n>` value says it holds the job's state (pure):
    JSON `{"state": true}` (collective.elastic.rendezvous). Empty or absent: no."""
    if not value:
        return False
    try:
        msg = json.loads(value)
    except ValueError:
        return False
    return isinstance(msg, dict) and msg.get("state") is True


def host_update_flags(prev: Mapping[str, int], cur: Mapping[str, int]) -> int:
    """Horovod's `HostUpdateResult` of a discovery change (pure): `removed` when a host or some
    of its slots went away, `added` when a host or slots appeared, both when both happened."""
    flags = HostUpdateResult.no_update
    for host in set(prev) | set(cur):
        if cur.get(host, 0) < prev.get(host, 0):
            flags |= HostUpdateResult.removed
        elif cur.get(host, 0) > prev.get(host, 0):
            flags |= HostUpdateResult.added
    return flags


class ElasticDriver:
    """Runs one elastic job to completion (not reusable).

    Args:
        discovery: a `HostDiscovery` or a callable returning `{host: slots}`.
        spawner: starts and stops workers (`launcher.elastic.spawn.WorkerSpawner`).
        env_for: builds a new worker's complete environment from its first slot (the driver
            adds HOROVOD_ELASTIC and the worker id).
        server: the job's `ElasticKVServer`, started; its `on_ready` must call `ready`.
        num_proc: workers needed to start; min_np / max_np: the bounds afterwards.
        elastic_timeout: seconds to wait for `min_np` slots before giving up.
        reset_limit: the most resets (None: no limit).
        cooldown_range: (lo, hi) seconds of blacklist cooldown, or None (permanent).
        message: where driver messages go (stderr lines).
        straggler_timeout: seconds a live worker that sends no heartbeat (`alive.<worker>`,
            every 5 s) may keep the others waiting for a new round (it should fail its next
            collective within the tcp timeout); after that it is killed and counted as failed.
            A worker whose heartbeats go on is busy outside collectives (a rank-0 checkpoint
            or evaluation): it is waited for up to the elastic timeout.
    """

    def __init__(self, discovery: Any, spawner: WorkerSpawner,
                 env_for: Callable[[SlotInfo], dict[str, str]], server: KVServer, *,
                 num_proc: int, min_np: int, max_np: int | None, elastic_timeout: float = 600.0,
                 reset_limit: int | None = None,
                 cooldown_range: tuple[float, float] | None = None,
                 message: Callable[[str], None] | None = None,
                 discovery_interval: float = DISCOVERY_INTERVAL_S,
                 grace_period: float = GRACE_PERIOD_S,
                 straggler_timeout: float = 90.0) -> None:
        if min_np < 1 or num_proc < min_np or (max_np is not None and max_np < num_proc):
            raise ValueError(f"elastic sizes must satisfy 1 <= --min-np ({min_np}) <= -np "
                             f"({num_proc}) <= --max-np ({max_np})")
        self.discovery: HostDiscovery = as_discovery(discovery)
        self.spawner = spawner
        self.env_for = env_for
        self.server = server
        self.num_proc, self.min_np, self.max_np = num_proc, min_np, max_np
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.hosts = HostManager(cooldown_range)
        self._message = message or (lambda text: None)
        self._interval = discovery_interval
        self._straggler_timeout = straggler_timeout
        self._waiting_since: float | None = None
        self._straggler_msg = 0.0
        self._discovery_failures = 0
        # Survivors' answers of the latest round, held until its new workers have asked.
        self._held: dict[int, tuple[int, dict[str, Any]]] = {}
        self._held_new: list[int] = []
        self._held_since = self._held_msg = 0.0
        self._discovery_error: str | None = None
        self._discovery_msg = 0.0
        self._stopped_stragglers: set[int] = set()
        self._grace = grace_period
        self._events: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._workers: dict[int, _Worker] = {}
        self._next_id = 0
        self._round = 0
        # Whether some worker has said it holds the job's state (once it has, a round whose
        # workers all lack it would broadcast a new worker's initial state: it stops instead).
        self._state_seen = False
        self.resets = 0
        self._updates = 0
        self._notified: tuple | None = None
        self._forming_since: float | None = None
        self._last_wait_msg = 0.0
        self._stop_reason: str | None = None
        self._stopping_since: float | None = None
        self._killed = False
        self._interrupted: int | None = None
        self._failures: list[str] = []
        self._blacklist_log: list[str] = []
        self._started = 0
        self._removed = 0
        self._closed = threading.Event()
        # Wall-clock times of the last round's driver phases (benchmarks read them).
        self.timings: dict[str, float] = {}

    # -- inputs (any thread) --------------------------------------------------------------------
    def ready(self, worker_id: int, seq: int) -> None:
        self._events.put(("ready", worker_id, seq))

    def _on_exit(self, worker_id: int, code: int, sig_name: str | None) -> None:
        self._events.put(("exit", worker_id, (code, sig_name)))

    # -- main loop ------------------------------------------------------------------------------
    def run(self, first_hosts: Mapping[str, int] | None = None) -> ElasticResult:
        """Starts the job and returns when every worker has exited.

        Args:
            first_hosts: the result of a discovery run the caller just made (hvdrun's, to
                choose the server address): the job starts from it instead of running the
                discovery script again, whose failure would then fail the start.

        Raises:
            DiscoveryError: the first host discovery failed.
        """
        self.hosts.update(first_hosts if first_hosts is not None
                          else self.discovery.find_available_hosts_and_slots())
        old = self._install_signal_handlers()
        poller = threading.Thread(target=self._poll_hosts, name="hvdrun-discovery",
                                  daemon=True)
        poller.start()
        try:
            self._start()
            while self._workers and any(w.exit is None for w in self._workers.values()) \
                    or (self._forming_since is not None and self._stop_reason is None):
                self._step()
        finally:
            self._closed.set()
            close = getattr(self.discovery, "close", None)
            if close is not None:  # a discovery run in progress must not outlive the job
                close()
            poller.join(timeout=5.0)
            for w in self._workers.values():
                if w.exit is None:
                    self.spawner.stop(w.id, signal.SIGKILL)
            self.spawner.close()
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return self._result()

    def _step(self) -> None:
        timeout = 0.5
        if self._stopping_since is not None and not self._killed:
            timeout = max(0.0, min(timeout, self._stopping_since + self._grace
                                   - time.monotonic()))
        try:
            kind, a, b = self._events.get(timeout=timeout)
        except queue.Empty:
            kind, a, b = "tick", None, None
        if kind == "ready":
            w = self._workers.get(a)
            if w is not None and w.exit is None:
                if not any(x.live and x.waiting for x in self._workers.values()):
                    self.timings = {"first_ready": time.time()}
                w.ready_seq = max(w.ready_seq, b)
                if ready_holds_state(self.server.get(SCOPE, f"ready.{a}.{b}")):
                    w.holds_state = self._state_seen = True
                self.server.delete(SCOPE, f"ready.{a}.{b}")
        elif kind == "exit":
            self._worker_exited(a, *b)
        elif kind == "hosts":
            if self._discovery_failures:
                self._message(f"hvdrun: host discovery works again (after "
                              f"{self._discovery_failures} failed run(s))")
                self._discovery_failures, self._discovery_error = 0, None
            self.hosts.update(b)
        elif kind == "discovery_error":
            self._discovery_failed(a)
        elif kind == "signal":
            name = signal.Signals(a).name
            if self._stopping_since is None:
                self._interrupted = a
                self._stop(f"hvdrun received {name}")
            elif not self._killed:
                self._kill_all()
        if self._stopping_since is not None:
            if not self._killed and time.monotonic() >= self._stopping_since + self._grace:
                self._kill_all()
            return
        if self._held:
            self._check_held()
            return
        self._check_barrier()
        if self._forming_since is not None:
            self._try_assign()
        else:
            self._check_hosts()

    # -- start ----------------------------------------------------------------------------------
    def _start(self) -> None:
        deadline = time.monotonic() + self.elastic_timeout
        while self.hosts.total_slots() < self.num_proc:
            self._say_waiting(self.num_proc, deadline)
            if time.monotonic() >= deadline:
                self._stop(self._timeout_message(self.num_proc))
                return
            try:
                kind, a, b = self._events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "hosts":
                self.hosts.update(b)
            elif kind == "signal":
                self._interrupted = a
                self._stop(f"hvdrun received {signal.Signals(a).name}")
                return
        slots, _, new, _ = assign_slots(self.hosts.available(), [], self.max_np)
        self._notified = self._signature()
        self._message(f"hvdrun: elastic job starting {len(slots)} worker(s) on "
                      f"{self._describe(slots)}")
        # Every worker is answered once all have asked (called hvd.init()): a worker slower to
        # start than HOROVOD_GLOO_TIMEOUT_SECONDS does not make the others' rendezvous fail.
        self._held_new = [self._launch(s, sync=True, hold=True) for s in new]
        self._held_since = self._held_msg = time.monotonic()

    # -- workers --------------------------------------------------------------------------------
    def _launch(self, slot: SlotInfo, sync: bool, hold: bool = False) -> int:
        """Starts a worker for `slot`; its place is written at once, or with `hold` kept in
        `_held` until `_check_held` releases it."""
        wid = self._next_id
        self._next_id += 1
        w = _Worker(wid, slot.hostname, slot.rank, answered_seq=-1, round=self._round)
        self._workers[wid] = w
        if hold:
            self._held[wid] = (0, self._assignment(slot, sync))
        else:
            self._answer(w, 0, self._assignment(slot, sync))
        env = dict(self.env_for(slot))
        env["HOROVOD_ELASTIC"] = "1"
        env[WORKER_ID_ENV] = str(wid)
        self._started += 1
        self.spawner.spawn(wid, slot.hostname, env, self._on_exit)
        return wid

    def _assignment(self, slot: SlotInfo, sync: bool) -> dict[str, Any]:
        """A worker's place in this round; `sync`: the round has a worker that was not in the
        previous one (it syncs the state from rank 0, so every worker must)."""
        return {"rank": slot.rank, "size": slot.size, "local_rank": slot.local_rank,
                "local_size": slot.local_size, "cross_rank": slot.cross_rank,
                "cross_size": slot.cross_size, "scope": f"ringvod/elastic/{self._round}",
                "updates": self._updates, "sync": sync}

    def _answer(self, w: _Worker, seq: int, msg: dict[str, Any]) -> None:
        w.answered_seq = seq
        self.server.put(SCOPE, f"assign.{w.id}.{seq}", json.dumps(msg).encode())

    def _worker_exited(self, wid: int, code: int, sig_name: str | None) -> None:
        w = self._workers.get(wid)
        if w is None or w.exit is not None:
            return
        w.exit = (code, sig_name)
        if w.removed or self._stopping_since is not None or code == 0:
            return
        w.failed = True
        what = f"worker {wid} (rank {w.rank} on host {w.host})"
        self._message(f"hvdrun: {what} exited with status code {describe_exit(code, sig_name)}.")
        self._failures.append(f"{what}: exit code {describe_exit(code, sig_name)}")
        if not self.hosts.is_blacklisted(w.host):
            cooldown = self.hosts.blacklist(w.host)
            how = "for good" if cooldown is None else f"for {cooldown:.1f} s"
            text = f"blacklisting host {w.host} {how}: {what} failed"
            self._blacklist_log.append(f"{w.host} ({what} failed)")
            self._message(f"hvdrun: {text}")
            # The survivors re-form after the failure anyway: no host update to announce.
            self._notified = self._signature()
        if not any(x.live for x in self._workers.values()) and not self._finished_this_round():
            self._stop("no worker is left to continue the job")
        # (With a peer that finished in this round, the job is over: `_result` says why.)

    def _finished_this_round(self) -> bool:
        return any(w.exit is not None and w.exit[0] == 0 and not w.removed
                   and w.round == self._round for w in self._workers.values())

    def _kill_all(self) -> None:
        for w in self._workers.values():
            if w.exit is None:
                self.spawner.stop(w.id, signal.SIGKILL)
        self._killed = True

    def _stop(self, reason: str) -> None:
        if self._stopping_since is not None:
            return
        self._stop_reason = reason
        self._forming_since = None
        self._stopping_since = time.monotonic()
        for w in self._workers.values():
            if w.exit is None and w.waiting:  # told why; it exits by itself (else SIGKILL)
                self._answer(w, w.ready_seq, {"stop": reason})
            elif w.exit is None:
                self.spawner.stop(w.id, signal.SIGTERM)

    # -- rounds ---------------------------------------------------------------------------------
    def _check_barrier(self) -> None:
        if self._forming_since is not None:
            return
        live = [w for w in self._workers.values() if w.live]
        if not any(w.waiting for w in live):
            self._waiting_since = None
            return
        if not all(w.waiting for w in live):
            self._check_stragglers([w for w in live if not w.waiting])
            return
        self._waiting_since = None
        self._stopped_stragglers.clear()
        self.timings["barrier"] = time.time()
        finished = [w for w in self._workers.values()
                    if w.exit is not None and w.exit[0] == 0 and not w.removed]
        if finished:
            self._stop(f"worker {finished[0].id} finished while the others asked to reset; "
                       "the job has ended")
            return
        if self._stop_if_survivors_blacklisted([w for w in self._workers.values() if w.live]):
            return
        if self.reset_limit is not None and self.resets >= self.reset_limit:
            self._stop(RESET_LIMIT_MESSAGE.format(self.reset_limit))
            return
        self.resets += 1
        self._forming_since = time.monotonic()
        self._last_wait_msg = 0.0

    def _check_stragglers(self, stragglers: list[_Worker]) -> None:
        """Some workers asked for a new round, `stragglers` not yet. One that sent no heartbeat
        for the straggler timeout is stopped, frozen or cut off: it is killed (a failure, which
        completes the barrier). One whose heartbeats go on is busy outside collectives: it is
        waited for (Horovod waits for every worker) up to the elastic timeout."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = self._straggler_msg = now
            return
        beats = self.server.heartbeats() if hasattr(self.server, "heartbeats") else {}
        waited = now - self._waiting_since
        busy_limit = max(self.elastic_timeout, self._straggler_timeout)
        busy = []
        for w in stragglers:
            if w.id in self._stopped_stragglers:
                continue
            what = f"worker {w.id} (rank {w.rank} on host {w.host})"
            silent = now - max(self._waiting_since, beats.get(w.id, float("-inf")))
            if silent > self._straggler_timeout:
                why = (f"did not rejoin within {waited:.0f} s of the others asking for a new "
                       f"round, and sent no heartbeat for {silent:.0f} s (stopped, hung or cut "
                       "off); stopping it")
            elif waited > busy_limit:
                why = (f"is alive but did not rejoin within {busy_limit:g} s (--elastic-timeout)"
                       " of the others asking for a new round; stopping it")
            else:
                if now - beats.get(w.id, float("-inf")) <= 3 * HEARTBEAT_INTERVAL_S:
                    busy.append(what)  # heard from lately (else: silent, maybe stopped)
                continue
            self._message(f"hvdrun: {what} {why}")
            self._stopped_stragglers.add(w.id)
            self.spawner.stop(w.id, signal.SIGKILL)  # its exit (a failure) completes the barrier
        if busy and now - self._straggler_msg >= 30.0:
            self._straggler_msg = now
            self._message(f"hvdrun: waiting for {', '.join(busy)} to ask for a new round too: "
                          "alive, but busy outside collectives for "
                          f"{waited:.0f} s (given up on after {busy_limit:g} s, "
                          "--elastic-timeout)")

    def _check_held(self) -> None:
        """Answers the survivors of a round with new workers (and, at start, every worker)
        once every new worker has asked for its place (its first `init()`), or exited. The
        new workers' rendezvous then waits for survivors that are ready, instead of survivors
        waiting in theirs, which gives up after HOROVOD_GLOO_TIMEOUT_SECONDS, for a worker
        still starting up (slow imports, CUDA or data set-up before `hvd.init()`): that failed
        the new worker and blacklisted its host. A new worker that has not asked within the
        elastic timeout is killed. At start, a worker gone before it asked is planned out."""
        now = time.monotonic()
        late = [self._workers[i] for i in self._held_new
                if self._workers[i].ready_seq < 0 and self._workers[i].exit is None]
        if late and now - self._held_since <= self.elastic_timeout:
            if now - self._held_msg >= 30.0:
                self._held_msg = now
                self._message(f"hvdrun: round {self._round} waits for new worker(s) "
                              f"{', '.join(str(w.id) for w in late)} to start (to call "
                              f"hvd.init()) for {now - self._held_since:.0f} s (given up on "
                              f"after {self.elastic_timeout:g} s, --elastic-timeout)")
            return
        for w in late:
            self._message(f"hvdrun: new worker {w.id} (rank {w.rank} on host {w.host}) did "
                          f"not call hvd.init() within {self.elastic_timeout:g} s "
                          "(--elastic-timeout); stopping it")
            self.spawner.stop(w.id, signal.SIGKILL)
        late_ids = {w.id for w in late}
        if self._round == 0 and any(self._workers[i].exit is not None or i in late_ids
                                    for i in self._held_new):
            # At start nobody has been answered yet: rather than send every worker into a
            # rendezvous that waits in vain for one that is gone, plan the start again
            # without it (the others have all asked: they form round 1).
            self._held, self._held_new = {}, []
            if any(w.live for w in self._workers.values()):
                self._forming_since = time.monotonic()
                self._last_wait_msg = 0.0
            return
        held, self._held, self._held_new = self._held, {}, []
        for wid, (seq, msg) in held.items():
            w = self._workers[wid]
            if w.exit is None:
                self._answer(w, seq, msg)

    def _stop_if_survivors_blacklisted(self, live: list[_Worker]) -> bool:
        """Stops the job when every live worker's host is blacklisted for good: none of them
        can keep a place, whatever hosts come (Horovod: every recorded host is blacklisted),
        so there is nothing to wait --elastic-timeout for."""
        if not live or not all(self.hosts.blacklisted_for_good(w.host) for w in live):
            return False
        hosts = sorted({w.host for w in live})
        many = len(hosts) > 1
        self._stop("No hosts from previous set remaining, unable to broadcast state: the "
                   f"surviving workers' host{'s' if many else ''} {', '.join(hosts)} "
                   f"{'are' if many else 'is'} blacklisted")
        return True

    def _stop_if_slots_cannot_come(self, need: int) -> bool:
        """Stops the job when fewer than `need` slots are left and no more can come: the hosts
        are a fixed list (-H/--hostfile) and the missing ones are blacklisted for good, so
        waiting --elastic-timeout (600 s by default) would change nothing."""
        if not isinstance(self.discovery, FixedHosts) or self.hosts.cooldown_range is not None:
            return False
        fixed = self.discovery.find_available_hosts_and_slots()
        possible = sum(n for h, n in fixed.items() if not self.hosts.blacklisted_for_good(h))
        if possible >= need:
            return False
        black = [h for h in fixed if self.hosts.blacklisted_for_good(h)]
        many = len(black) > 1
        self._stop(f"Only {possible} slot(s) left for --min-np {need}, and no more can come: "
                   f"the hosts are the fixed list {self._describe_hosts(fixed)} (-H/--hostfile)"
                   f" and {', '.join(black)} {'are' if many else 'is'} blacklisted for good. "
                   "Lower --min-np, give more hosts, or let failed hosts come back "
                   "(--blacklist-cooldown-range) or be replaced (--host-discovery-script).")
        return True

    def _try_assign(self) -> None:
        assert self._forming_since is not None
        live = [w for w in self._workers.values() if w.live]
        if not live:  # the waiting workers died meanwhile
            self._forming_since = None
            return
        if not all(w.waiting for w in live):
            return
        if self._stop_if_survivors_blacklisted(live):
            return
        have = self.hosts.total_slots()
        need = self.min_np
        if have < need:
            if self._stop_if_slots_cannot_come(need):
                return
            deadline = self._forming_since + self.elastic_timeout
            self._say_waiting(need, deadline)
            if time.monotonic() >= deadline:
                self._stop(self._timeout_message(need))
            return
        survivors = [(w.id, w.host, w.rank) for w in live]
        holders = {w.id for w in live if w.holds_state}
        slots, placed, new, removed = assign_slots(self.hosts.available(), survivors,
                                                   self.max_np, holders)
        if not placed:
            self._stop("No hosts from previous set remaining, unable to broadcast state.")
            return
        if self._state_seen and not holders & placed.keys():
            # Every worker that holds the state is gone (or has no slot left): rank 0 would
            # broadcast a new worker's initial model and state, silently losing the job's
            # progress.
            gone = [w for w in live if w.holds_state and w.id not in placed]
            self._stop("No worker that holds the job's state remains, unable to broadcast "
                       "state: the workers left have never received it (they joined, and "
                       "their first state sync failed)"
                       + (f"; {len(gone)} that hold it have no slot left" if gone else "")
                       + ".")
            return
        self._round += 1
        self._forming_since = None
        self._notified = self._signature()
        for wid in removed:
            w = self._workers[wid]
            w.removed = True
            self._removed += 1
            self._answer(w, w.ready_seq, {"removed": f"{w.host}[{w.id}] has been removed from "
                                                     "elastic job"})
        for wid, slot in placed.items():
            w = self._workers[wid]
            w.rank, w.round = slot.rank, self._round
            msg = self._assignment(slot, sync=bool(new))
            if new:  # answered once the new workers have asked for their place
                self._held[wid] = (w.ready_seq, msg)
            else:
                self._answer(w, w.ready_seq, msg)
        self._held_new = [self._launch(s, sync=True) for s in new]
        self._held_since = self._held_msg = time.monotonic()
        self.timings["assigned"] = time.time()
        self._message(f"hvdrun: elastic round {self._round} (reset {self.resets}): "
                      f"{len(slots)} worker(s) on {self._describe(slots)}"
                      + (f"; {len(new)} new" if new else "")
                      + (f"; {len(removed)} removed" if removed else ""))

    # -- host changes ---------------------------------------------------------------------------
    def _signature(self) -> tuple:
        return tuple((h.hostname, h.slots) for h in self.hosts.available())

    def _check_hosts(self) -> None:
        sig = self._signature()
        if sig == self._notified:
            return
        prev, self._notified = dict(self._notified or ()), sig
        avail = dict(sig)
        flags = host_update_flags(prev, avail)
        live = [(w.id, w.host, w.rank) for w in self._workers.values() if w.live]
        holders = {w.id for w in self._workers.values() if w.live and w.holds_state}
        _, _, new, removed = assign_slots(self.hosts.available(), live, self.max_np, holders)
        if flags == HostUpdateResult.no_update or not (new or removed):
            return  # no slot changed, or none that changes the assignment
        self._updates += 1
        self.timings["update"] = time.time()
        what = {1: "removed", 2: "added", 3: "added and removed"}[flags]
        self._message(f"hvdrun: hosts {what}: now {self._describe_hosts(avail)}; asking the "
                      "workers to re-form")
        self.server.put(SCOPE, f"update.{self._updates - 1}",
                        json.dumps([self._updates, flags]).encode())

    def _poll_hosts(self) -> None:
        while not self._closed.wait(self._interval):
            try:
                self._events.put(("hosts", None,
                                  self.discovery.find_available_hosts_and_slots()))
            except Exception as exc:  # noqa: BLE001 - later failures are logged and retried
                self._events.put(("discovery_error", str(exc), None))

    # -- messages -------------------------------------------------------------------------------
    def _discovery_failed(self, text: str) -> None:
        """Reports a failed discovery run (polled every second): the first failure, a new
        error text, and then once a minute with the count, not once a second."""
        self._discovery_failures += 1
        now = time.monotonic()
        if text == self._discovery_error and now - self._discovery_msg < 60.0:
            return
        self._discovery_error, self._discovery_msg = text, now
        again = (f" ({self._discovery_failures} failed runs so far)"
                 if self._discovery_failures > 1 else "")
        self._message(f"hvdrun: host discovery failed{again}; keeping the hosts found last "
                      f"and retrying every {self._interval:g} s: {text}")

    def _say_waiting(self, need: int, deadline: float) -> None:
        now = time.monotonic()
        if now - self._last_wait_msg < 10.0:
            return
        self._last_wait_msg = now
        self._message(f"hvdrun: waiting for {need} slots, have {self.hosts.total_slots()} "
                      f"(giving up in {max(deadline - now, 0):.0f} s, --elastic-timeout)")

    def _timeout_message(self, need: int) -> str:
        avail = {h.hostname: h.slots for h in self.hosts.available()}
        black = self.hosts.blacklisted()
        return (f"Timed out after {self.elastic_timeout:g} s waiting for {need} slots; have "
                f"{sum(avail.values())} ({self._describe_hosts(avail) or 'no hosts'}"
                + (f"; blacklisted: {', '.join(black)}" if black else "") + "). Add hosts, "
                "lower --min-np or raise --elastic-timeout (HOROVOD_ELASTIC_TIMEOUT).")

    @staticmethod
    def _describe_hosts(avail: Mapping[str, int]) -> str:
        return ",".join(f"{h}:{n}" for h, n in avail.items())

    @staticmethod
    def _describe(slots: list[SlotInfo]) -> str:
        counts: dict[str, int] = {}
        for s in slots:
            counts[s.hostname] = counts.get(s.hostname, 0) + 1
        return ",".join(f"{h}:{n}" for h, n in counts.items())

    def _result(self) -> ElasticResult:
        last = [w for w in self._workers.values() if not w.removed and not w.failed]
        # A worker that failed in the last round fails the job (Horovod: any non-zero exit in
        # the final rendezvous), whether its peers finished before or after it: only a
        # failure that the survivors recovered from (by forming a new round) is forgiven.
        broken = [w for w in self._workers.values() if w.failed and w.round == self._round]
        reason = self._stop_reason
        if reason is None and broken:
            who = ", ".join(f"worker {w.id} (rank {w.rank} on host {w.host})" for w in broken)
            reason = (f"{who} failed in the last round, which its peers finished without "
                      "re-forming the job")
        ok = (reason is None and bool(last)
              and all(w.exit is not None and w.exit[0] == 0 for w in last))
        final = [w for w in last if w.exit is not None and w.exit[0] == 0]
        status = "finished" if ok else "failed"
        lines = [f"hvdrun: elastic job {status}"
                 + (f": {reason.rstrip('.')}" if reason else "") + "."]
        lines.append(f"  {self._round + 1} round(s), {self.resets} reset(s); {self._started} "
                     f"worker(s) started, {len(self._failures)} failed, {self._removed} "
                     f"removed; final size {len(final) if ok else 0}")
        for f in self._failures:
            lines.append(f"  failed: {f}")
        for b in self._blacklist_log:
            lines.append(f"  blacklisted: {b}")
        code = 0 if ok else (128 + self._interrupted if self._interrupted else 1)
        return ElasticResult(code, "\n".join(lines), None if ok else reason
                             or "workers failed", len(final) if ok else 0, self.resets,
                             sorted(w.rank for w in final))

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return catch_signals(lambda s, _f: self._events.put(("signal", s, None)))
