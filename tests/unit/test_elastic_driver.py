"""Pure parts of the elastic driver: slot assignment, host order and blacklist, discovery
output, and the CLI's validation of the elastic flags; the driver's rounds with fake workers;
the launcher's rendezvous address and its warning for hosts that cannot reach it."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import threading
import time

import pytest

from launcher import network
from launcher.cli import build_parser
from launcher.elastic.cli import elastic_settings_from_args
from launcher.elastic.discovery import (DiscoveryError, FixedHosts, HostDiscoveryScript,
                                        HostManager,
                                        as_discovery, parse_discovery_output)
from launcher.elastic.driver import (SCOPE, ElasticDriver, ElasticResult, HostUpdateResult,
                                     assign_slots, host_update_flags, ready_holds_state)
from launcher.elastic.launch import run_elastic, unreachable_server_warning
from launcher.hosts import HostInfo, SlotInfo


def test_assign_survivors_first_then_new_hosts() -> None:
    hosts = [HostInfo("a", 2), HostInfo("b", 1), HostInfo("c", 2)]
    # Survivors: worker 5 (was rank 1) on b, worker 7 (was rank 0) on c.
    slots, placed, new, removed = assign_slots(hosts, [(5, "b", 1), (7, "c", 0)], None)
    assert [s.hostname for s in slots] == ["b", "c", "c", "a", "a"]
    assert placed[5].rank == 0 and placed[7].rank == 1  # host order decides, survivors first
    assert [(s.hostname, s.local_rank) for s in new] == [("c", 1), ("a", 0), ("a", 1)]
    assert removed == []
    assert all(s.size == 5 for s in slots)


def test_assign_respects_max_np_and_removes_extra_survivors() -> None:
    hosts = [HostInfo("a", 1), HostInfo("b", 4)]
    slots, placed, new, removed = assign_slots(
        hosts, [(1, "a", 0), (2, "b", 1), (3, "b", 2), (4, "gone", 3)], 2)
    assert len(slots) == 2 and not new
    assert placed[1].rank == 0 and placed[2].rank == 1
    assert sorted(removed) == [3, 4]


def test_assign_cross_ranks() -> None:
    slots, _, new, _ = assign_slots([HostInfo("a", 2), HostInfo("b", 2)], [], 3)
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank, s.cross_size) for s in new] == [
        ("a", 0, 0, 0, 2), ("a", 1, 1, 0, 1), ("b", 2, 0, 1, 2)]


def test_assign_puts_a_worker_that_holds_the_state_at_rank_0() -> None:
    """Worker 9 joined on host a (the oldest) and its first sync failed: it holds only its
    initial state. Rank 0 (whose state the sync broadcasts) is worker 5, which holds the
    job's; the ranks stay grouped by host (holders' hosts first, then host order)."""
    hosts = [HostInfo("a", 2), HostInfo("b", 2), HostInfo("c", 1)]
    survivors = [(9, "a", 2), (5, "b", 0), (6, "b", 1)]
    slots, placed, new, removed = assign_slots(hosts, survivors, None, holders={5, 6})
    assert [s.hostname for s in slots] == ["b", "b", "a", "a", "c"]
    assert (placed[5].rank, placed[6].rank, placed[9].rank) == (0, 1, 2)
    assert (placed[9].local_rank, placed[9].cross_rank) == (0, 1)
    assert [(s.hostname, s.local_rank) for s in new] == [("a", 1), ("c", 0)] and not removed
    # The old order (no holder known): host a first, the new worker is rank 0.
    _, placed, _, _ = assign_slots(hosts, survivors, None)
    assert placed[9].rank == 0


def test_assign_holders_first_on_their_host_and_kept_first() -> None:
    """On one host the holder takes local rank 0 even with a higher previous rank; when
    slots run short, holders keep theirs before the others."""
    hosts = [HostInfo("a", 2), HostInfo("b", 1)]
    _, placed, _, _ = assign_slots(hosts, [(3, "a", 0), (4, "a", 1)], None, holders={4})
    assert (placed[4].rank, placed[3].rank) == (0, 1)
    _, placed, new, removed = assign_slots(hosts, [(3, "a", 0), (4, "a", 1)], 1, holders={4})
    assert list(placed) == [4] and placed[4].rank == 0 and removed == [3] and not new
    # Everyone a holder, or nobody: the previous order, as before.
    for holders in ({3, 4, 7}, set()):
        _, placed, _, _ = assign_slots(hosts, [(7, "b", 0), (3, "a", 1), (4, "a", 2)], None,
                                       holders=holders)
        assert (placed[3].rank, placed[4].rank, placed[7].rank) == (0, 1, 2)


def test_ready_value_says_whether_the_worker_holds_the_state() -> None:
    assert ready_holds_state(b'{"state": true}')
    for value in (None, b"", b'{"state": false}', b"junk", b"[1]", b'{"state": 1}'):
        assert not ready_holds_state(value), value


def test_host_update_flags_compare_slots_per_host() -> None:
    removed, added = HostUpdateResult.removed, HostUpdateResult.added
    mixed = HostUpdateResult.mixed
    assert host_update_flags({"a": 2, "b": 2}, {"b": 2, "a": 2}) == HostUpdateResult.no_update
    assert host_update_flags({"a": 2, "b": 2}, {"a": 2}) == removed
    assert host_update_flags({"a": 2, "b": 2}, {"a": 1, "b": 2}) == removed
    assert host_update_flags({"a": 2}, {"a": 2, "b": 1}) == added
    assert host_update_flags({"a": 2}, {"a": 3}) == added
    assert host_update_flags({"a": 2, "b": 2}, {"a": 1, "b": 3}) == mixed  # slots moved
    assert host_update_flags({"a": 2, "b": 2}, {"a": 2, "c": 2}) == mixed  # b gone, c new


class _FakeSpawner:
    def __init__(self) -> None:
        self.spawned: list[tuple[int, str]] = []

    def spawn(self, worker_id, hostname, env, on_exit) -> None:
        self.spawned.append((worker_id, hostname))

    def stop(self, worker_id, sig) -> None:
        pass

    def close(self) -> None:
        pass


class _FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def put(self, scope, key, value) -> None:
        self.data[key] = json.loads(value)

    def get(self, scope, key):
        return json.dumps(self.data[key]).encode() if key in self.data else None

    def delete(self, scope, key) -> None:
        self.data.pop(key, None)


def _begin(d: ElasticDriver) -> None:
    """Starts the job; every worker then asks for its place (its first init())."""
    d._start()
    for wid in list(d._workers):
        d.ready(wid, 0)
        d._step()


def _driver(hosts: dict[str, int], num_proc: int, max_np: int | None):
    spawner, store = _FakeSpawner(), _FakeStore()
    d = ElasticDriver(lambda: hosts, spawner, lambda slot: {}, store, num_proc=num_proc,
                      min_np=1, max_np=max_np)
    d.hosts.update(hosts)
    _begin(d)
    return d, spawner, store


def _next_round(d: ElasticDriver, hosts: dict[str, int], meanwhile: dict[str, int] | None
                ) -> None:
    """Discovery finds `hosts` (announced); then every worker asks for its place (its second
    init); discovery finds `meanwhile` just before the last one asks."""
    d._events.put(("hosts", None, hosts))
    d._step()
    workers = list(d._workers)
    for wid in workers:
        if wid == workers[-1] and meanwhile:
            d.hosts.update(meanwhile)
        d.ready(wid, 1)
        d._step()


@pytest.mark.parametrize("num_proc, max_np, before, after, meanwhile, flags, new", [
    # Slots move from a to b: a's second worker goes, a new one starts on b.
    (4, None, {"a": 2, "b": 2}, {"a": 1, "b": 3}, None, HostUpdateResult.mixed, ["b"]),
    # Only removed, but b has a free slot under --max-np: the round starts a worker there.
    (3, 3, {"a": 2, "b": 2}, {"a": 1, "b": 2}, None, HostUpdateResult.removed, ["b"]),
    # Only removed, then host c appears before the round forms: a worker starts there.
    (4, None, {"a": 2, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 1},
     HostUpdateResult.removed, ["c"]),
    # Only removed, and no free slot: no new worker, the survivors skip the sync.
    (4, None, {"a": 2, "b": 2}, {"a": 1, "b": 2}, None, HostUpdateResult.removed, []),
])
def test_round_with_a_new_worker_tells_every_survivor_to_sync(
        num_proc, max_np, before, after, meanwhile, flags, new) -> None:
    d, spawner, store = _driver(before, num_proc, max_np)
    _next_round(d, after, meanwhile)
    assert store.data["update.0"] == [1, flags] and "update.1" not in store.data
    assert [host for _, host in spawner.spawned[num_proc:]] == new
    for wid, _ in spawner.spawned[num_proc:]:  # the new workers ask: the survivors are answered
        d.ready(wid, 0)
        d._step()
    answers = [store.data[f"assign.{wid}.1"] for wid in range(num_proc)]
    assert sum("removed" in a for a in answers) == 1, answers
    assert [a["sync"] for a in answers if "rank" in a] == [bool(new)] * (num_proc - 1), answers



def _ask(d: ElasticDriver, store: _FakeStore, wid: int, seq: int, state: bool) -> None:
    """Worker `wid` asks for its place (its init() number `seq`), saying whether it holds
    the job's state, as collective.elastic.rendezvous does."""
    store.put(SCOPE, f"ready.{wid}.{seq}", json.dumps({"state": state}).encode())
    d.ready(wid, seq)
    d._step()


@pytest.mark.parametrize("holder_dies", [False, True], ids=["holder-left", "no-holder-left"])
@pytest.mark.timeout(30)
def test_new_worker_whose_first_sync_failed_is_not_rank_0(holder_dies) -> None:
    """Host a (found first) leaves and comes back; the worker started there (3) joins the
    survivors 1 (b) and 2 (c) at rank 2, and its first sync fails: worker 2 dies. In the next
    round worker 3, holding only its initial state, sits on the oldest host; the old order
    made it rank 0, and the sync broadcast its initial model and state to worker 1 (the
    job's progress silently lost). Worker 1 holds the state: it is rank 0. When worker 1 is
    gone too, no worker holds the state: the job stops instead."""
    d, spawner, store = _driver({"a": 1, "b": 1, "c": 1}, 3, 3)
    d._events.put(("hosts", None, {"b": 1, "c": 1}))  # a leaves: worker 0 is removed
    d._step()
    for wid in (0, 1, 2):
        _ask(d, store, wid, 1, True)
    assert "removed" in store.data["assign.0.1"]
    assert (store.data["assign.1.1"]["rank"], store.data["assign.2.1"]["rank"]) == (0, 1)
    d._events.put(("hosts", None, {"a": 1, "b": 1, "c": 1}))  # a is back (still found first)
    d._step()
    for wid in (1, 2):
        _ask(d, store, wid, 2, True)
    assert spawner.spawned[-1] == (3, "a")
    _ask(d, store, 3, 0, False)  # its first init()
    assert [store.data[f"assign.{w}.{n}"]["rank"] for w, n in ((1, 2), (2, 2), (3, 0))] == [
        0, 1, 2]
    d._on_exit(2, 137, "SIGKILL")  # during worker 3's first sync
    d._step()
    if holder_dies:
        d._on_exit(1, 137, "SIGKILL")
        d._step()
    else:
        _ask(d, store, 1, 3, True)
    _ask(d, store, 3, 1, False)  # its first sync failed: it restored its initial state
    if holder_dies:
        assert store.data["assign.3.1"] == {"stop": d._stop_reason}, store.data
        assert d._stop_reason.startswith(
            "No worker that holds the job's state remains, unable to broadcast state"), \
            d._stop_reason
        return
    one, three = store.data["assign.1.3"], store.data["assign.3.1"]
    assert (one["rank"], three["rank"], one["size"]) == (0, 1, 2), (one, three)
    assert (three["local_rank"], three["cross_rank"], three["cross_size"]) == (0, 1, 2)


@pytest.mark.parametrize("order", [(1, 0), (0, 1)], ids=["fails-first", "fails-last"])
@pytest.mark.timeout(30)
def test_a_failure_in_the_last_round_fails_the_job_in_either_order(order) -> None:
    """Worker 1 fails and worker 0 finishes without another collective (so no new round):
    the job failed, whichever exit the driver hears of first (on Ray, a big return value
    can reach it after a peer's later exception)."""
    d, _, _ = _driver({"a": 1, "b": 1}, 2, None)
    for wid in order:
        d._on_exit(wid, 0 if wid == 0 else 1, None)
        d._step()
    assert not any(w.exit is None for w in d._workers.values())
    res = d._result()
    assert res.exit_code == 1 and res.final_size == 0, res.summary
    assert res.error == ("worker 1 (rank 1 on host b) failed in the last round, which its "
                         "peers finished without re-forming the job"), res.error
    assert res.summary.startswith(f"hvdrun: elastic job failed: {res.error}."), res.summary


@pytest.mark.timeout(30)
def test_a_failure_the_survivors_re_formed_after_is_forgiven() -> None:
    d, _, store = _driver({"a": 1, "b": 1}, 2, None)
    d._on_exit(1, 1, None)  # worker 1 fails; host b is blacklisted
    d._step()
    d.ready(0, 1)  # worker 0's collective failed: it asks for its place in a new round
    d._step()
    assert store.data["assign.0.1"]["size"] == 1, store.data
    d._on_exit(0, 0, None)
    d._step()
    res = d._result()
    assert res.exit_code == 0 and res.final_size == 1 and res.error is None, res.summary
    assert "failed: worker 1 (rank 1 on host b): exit code 1" in res.summary

@pytest.mark.parametrize("cooldown", [None, (5.0, 10.0)], ids=["for-good", "cooldown"])
@pytest.mark.timeout(30)
def test_survivors_on_blacklisted_hosts_only(cooldown) -> None:
    """One host; a worker fails and the host is blacklisted. For good: no survivor can ever
    keep a place, so the job stops at once (Horovod: every recorded host is blacklisted); it
    waited --elastic-timeout (600 s) for slots. With a cooldown the host comes back: wait."""
    spawner, store = _FakeSpawner(), _FakeStore()
    d = ElasticDriver(lambda: {"a": 2}, spawner, lambda slot: {}, store, num_proc=2,
                      min_np=1, max_np=None, cooldown_range=cooldown)
    d.hosts.update({"a": 2})
    _begin(d)
    d._on_exit(1, 3, None)
    d._step()
    d.ready(0, 1)  # the survivor's collective failed: it asks for a new round
    d._step()
    d._step()
    if cooldown is None:
        assert store.data["assign.0.1"] == {"stop": d._stop_reason}, store.data
        assert d._stop_reason == (
            "No hosts from previous set remaining, unable to broadcast state: the surviving "
            "workers' host a is blacklisted"), d._stop_reason
        assert d.resets == 0
    else:
        assert d._stop_reason is None and "assign.0.1" not in store.data, store.data
        assert d._forming_since is not None  # waiting for the host's cooldown to end


class _KillingSpawner(_FakeSpawner):
    """Reports a SIGKILLed worker's exit to the driver, as hvdrun's spawner does."""

    def __init__(self) -> None:
        super().__init__()
        self.killed: list[int] = []
        self.driver = None

    def stop(self, worker_id, sig) -> None:
        if sig == signal.SIGKILL:
            self.killed.append(worker_id)
            self.driver._on_exit(worker_id, 137, "SIGKILL")


class _BeatingStore(_FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.beats: dict[int, float] = {}

    def heartbeats(self) -> dict[int, float]:
        return dict(self.beats)


@pytest.mark.parametrize("beating", [True, False], ids=["busy", "silent"])
@pytest.mark.timeout(30)
def test_a_worker_that_keeps_the_others_waiting(beating) -> None:
    """Worker 1 dies; worker 2 asks for a new round; worker 0 does not (yet). Silent (no
    heartbeat: stopped, frozen, cut off), it is killed after the straggler timeout. Busy
    outside collectives (a rank-0 checkpoint or evaluation; its heartbeats go on), it is
    waited for up to the elastic timeout, and then joins the round: it was killed after the
    straggler timeout, its host blacklisted for good, and with it the job."""
    spawner, store = _KillingSpawner(), _BeatingStore()
    messages: list[str] = []
    d = ElasticDriver(lambda: {"a": 2, "b": 1}, spawner, lambda slot: {}, store, num_proc=3,
                      min_np=1, max_np=None, elastic_timeout=5.0, straggler_timeout=1.0,
                      message=messages.append)
    spawner.driver = d
    d.hosts.update({"a": 2, "b": 1})
    _begin(d)
    d._on_exit(2, 137, "SIGKILL")  # worker 2 on b dies
    d._step()
    d.ready(1, 1)  # worker 1's collective failed
    d._step()
    deadline = time.monotonic() + 2.5  # each step waits up to 0.5 s for an event
    while time.monotonic() < deadline:
        if beating:
            store.beats[0] = time.monotonic()
        d._step()
    if not beating:
        assert spawner.killed == [0], messages
        assert "sent no heartbeat" in "\n".join(messages), messages
        assert d._stop_reason.startswith("No hosts from previous set remaining"), d._stop_reason
        return
    assert spawner.killed == [] and d._stop_reason is None, messages
    d.ready(0, 1)  # done with its checkpoint, worker 0 fails its next collective
    d._step()
    assert store.data["assign.0.1"]["size"] == 2 and store.data["assign.1.1"]["size"] == 2


@pytest.mark.timeout(30)
def test_a_busy_worker_is_stopped_after_the_elastic_timeout() -> None:
    spawner, store = _KillingSpawner(), _BeatingStore()
    messages: list[str] = []
    d = ElasticDriver(lambda: {"a": 1, "b": 1}, spawner, lambda slot: {}, store, num_proc=2,
                      min_np=1, max_np=None, elastic_timeout=1.2, straggler_timeout=0.8,
                      message=messages.append)
    spawner.driver = d
    d.hosts.update({"a": 1, "b": 1})
    _begin(d)
    d.ready(1, 1)
    d._step()
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline and not spawner.killed:
        store.beats[0] = time.monotonic()
        d._step()
    assert spawner.killed == [0], messages
    assert any("is alive but did not rejoin within 1.2 s (--elastic-timeout)" in m
               for m in messages), messages


@pytest.mark.timeout(30)
def test_worker_heartbeat_reaches_the_server(monkeypatch) -> None:
    import collective.elastic as worker
    from launcher.elastic.driver import ElasticKVServer

    monkeypatch.setattr(worker, "HEARTBEAT_INTERVAL_S", 0.05)
    secret = b"s" * 32
    server = ElasticKVServer("127.0.0.1", 0, secret, on_ready=lambda wid, seq: None)
    addr, port = server.start()
    try:
        beat = worker._Heartbeat()
        beat.start(addr, port, secret, "7")
        deadline = time.monotonic() + 10
        while 7 not in server.heartbeats() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = server.heartbeats()[7]
        while server.heartbeats()[7] == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.heartbeats()[7] > first  # it goes on
        assert server.get("elastic", "alive.7") is None  # nothing stored
        beat.stop()
        assert not any(t.name == "hvd-elastic-heartbeat" for t in threading.enumerate())
    finally:
        beat.stop()
        server.stop()


def test_server_ignores_worker_keys_with_non_ascii_digits() -> None:
    # str.isdigit() accepts '²', which int() refuses: such a key (from an authenticated
    # client) is not a worker's, and must not fail the put that carries it.
    from launcher.elastic.driver import ElasticKVServer

    ready: list[tuple[int, int]] = []
    server = ElasticKVServer("127.0.0.1", 0, b"s" * 32,
                             on_ready=lambda w, n: ready.append((w, n)))
    server.put(SCOPE, "alive.\u00b2", b"")
    server.put(SCOPE, "ready.\u00b2.1", b"{}")
    server.put(SCOPE, "ready.3.\u00b9", b"{}")
    server.put(SCOPE, "ready.3.1", b"{}")
    assert server.heartbeats() == {} and ready == [(3, 1)]


@pytest.mark.parametrize("cooldown", [None, (5.0, 10.0)], ids=["for-good", "cooldown"])
@pytest.mark.timeout(30)
def test_fixed_hosts_too_few_slots_for_min_np(cooldown) -> None:
    """-H a:1,b:1 --min-np 2: the worker on b fails and b is blacklisted for good. The fixed
    list cannot grow, so the job stops at once with the reason (it waited --elastic-timeout,
    600 s by default, for slots that could not come). With a cooldown b comes back: wait."""
    spawner, store = _FakeSpawner(), _FakeStore()
    d = ElasticDriver(FixedHosts({"a": 1, "b": 1}), spawner, lambda slot: {}, store,
                      num_proc=2, min_np=2, max_np=None, cooldown_range=cooldown)
    d.hosts.update({"a": 1, "b": 1})
    _begin(d)
    d._on_exit(1, 1, None)
    d._step()
    d.ready(0, 1)
    d._step()
    d._step()
    if cooldown is not None:
        assert d._stop_reason is None and d._forming_since is not None
        return
    assert d._stop_reason == (
        "Only 1 slot(s) left for --min-np 2, and no more can come: the hosts are the fixed "
        "list a:1,b:1 (-H/--hostfile) and b is blacklisted for good. Lower --min-np, give "
        "more hosts, or let failed hosts come back (--blacklist-cooldown-range) or be "
        "replaced (--host-discovery-script)."), d._stop_reason
    assert store.data["assign.0.1"] == {"stop": d._stop_reason}
    d._on_exit(0, 1, None)
    res = d._result()
    assert res.exit_code == 1
    assert res.summary.startswith(f"hvdrun: elastic job failed: {d._stop_reason}\n"), res.summary


def test_discovery_failures_are_reported_once_not_every_second() -> None:
    messages: list[str] = []
    d = ElasticDriver(lambda: {"a": 1}, _FakeSpawner(), lambda slot: {}, _FakeStore(),
                      num_proc=1, min_np=1, max_np=None, message=messages.append)
    d.hosts.update({"a": 1})
    _begin(d)
    messages.clear()
    for _ in range(5):
        d._events.put(("discovery_error", "script exited with status 2", None))
        d._step()
    d._events.put(("discovery_error", "script did not finish within 30 s", None))
    d._step()
    d._events.put(("hosts", None, {"a": 1}))
    d._step()
    assert messages == [
        "hvdrun: host discovery failed; keeping the hosts found last and retrying every 1 s: "
        "script exited with status 2",
        "hvdrun: host discovery failed (6 failed runs so far); keeping the hosts found last "
        "and retrying every 1 s: script did not finish within 30 s",
        "hvdrun: host discovery works again (after 6 failed run(s))"], messages


def test_summary_ends_with_one_period() -> None:
    d, _, _ = _driver({"a": 1}, 1, None)
    d._stop("No hosts from previous set remaining, unable to broadcast state.")
    assert d._result().summary.splitlines()[0] == (
        "hvdrun: elastic job failed: No hosts from previous set remaining, unable to "
        "broadcast state.")


@pytest.mark.parametrize("how", ["asks", "dies", "never"])
@pytest.mark.timeout(30)
def test_survivors_wait_for_the_new_workers_of_their_round(how) -> None:
    """A host appears; the round starts a worker there. The survivor's answer is held until
    the new worker has asked for its place (its first init()): written at once, the
    survivor's rendezvous gave up after HOROVOD_GLOO_TIMEOUT_SECONDS when the new worker
    took longer to start (slow imports, CUDA or data set-up), which failed the new worker
    and blacklisted its host. A new worker that dies first releases the survivor (whose
    rendezvous then fails and asks again); one that never asks is killed after the elastic
    timeout."""
    spawner, store = _KillingSpawner(), _FakeStore()
    messages: list[str] = []
    d = ElasticDriver(lambda: {"a": 1}, spawner, lambda slot: {}, store, num_proc=1,
                      min_np=1, max_np=None, elastic_timeout=1.0, message=messages.append)
    spawner.driver = d
    d.hosts.update({"a": 1})
    _begin(d)
    d._events.put(("hosts", None, {"a": 1, "b": 1}))
    d._step()
    d.ready(0, 1)  # the survivor's check_host_updates() raised: it asks for its place
    d._step()
    assert spawner.spawned == [(0, "a"), (1, "b")]
    assert store.data["assign.1.0"]["size"] == 2  # the new worker's place: written at start
    for _ in range(3):  # the new worker is still starting
        d._events.put(("tick", None, None))
        d._step()
    assert "assign.0.1" not in store.data, store.data
    if how == "asks":
        d.ready(1, 0)
        d._step()
    elif how == "dies":
        d._on_exit(1, 1, None)
        d._step()
    else:
        deadline = time.monotonic() + 3.0
        while "assign.0.1" not in store.data and time.monotonic() < deadline:
            d._step()
        assert spawner.killed == [1], messages
        assert any("new worker 1 (rank 1 on host b) did not call hvd.init() within 1 s"
                   in m for m in messages), messages
    assert store.data["assign.0.1"] == {**store.data["assign.1.0"], "rank": 0, "local_rank": 0,
                                        "cross_rank": 0}, store.data


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(30)
def test_job_end_kills_a_discovery_run_in_progress(tmp_path) -> None:
    """The job ends while a discovery run hangs (the poller runs the script every second):
    hvdrun kills it with what it started, instead of leaving it behind. The job starts from
    the hosts the caller found (hvdrun's first run), without running the script again."""
    count, pidfile = tmp_path / "count", tmp_path / "pid"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho x >> {count}\necho $$ > {pidfile}.tmp\n"
                      f"mv {pidfile}.tmp {pidfile}\nexec sleep 300\n")
    script.chmod(0o755)

    class ExitsLater(_FakeSpawner):
        def spawn(self, worker_id, hostname, env, on_exit) -> None:
            super().spawn(worker_id, hostname, env, on_exit)
            def finish():
                deadline = time.monotonic() + 10
                while not pidfile.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                on_exit(worker_id, 0, None)
            threading.Thread(target=finish, daemon=True).start()

    d = ElasticDriver(HostDiscoveryScript(str(script), timeout=60), ExitsLater(),
                      lambda slot: {}, _FakeStore(), num_proc=1, min_np=1, max_np=None,
                      discovery_interval=0.05)
    t0 = time.monotonic()
    res = d.run({"a": 1})
    assert res.exit_code == 0, res.summary
    assert time.monotonic() - t0 < 10
    assert count.read_text() == "x\n"  # only the poller's run: none at start
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the discovery run outlived the job"


@pytest.mark.timeout(30)
def test_workers_at_start_are_answered_once_all_have_asked() -> None:
    """At start every worker is answered once all have called init(): a worker slower to
    start than HOROVOD_GLOO_TIMEOUT_SECONDS (imports, CUDA, data set-up on a slow host) made
    the others' first rendezvous fail, and with it the whole job."""
    store = _FakeStore()
    d = ElasticDriver(lambda: {"a": 1, "b": 1}, _FakeSpawner(), lambda slot: {}, store,
                      num_proc=2, min_np=1, max_np=None)
    d.hosts.update({"a": 1, "b": 1})
    d._start()
    d.ready(0, 0)
    d._step()
    assert "assign.0.0" not in store.data and "assign.1.0" not in store.data
    d.ready(1, 0)
    d._step()
    assert store.data["assign.0.0"]["rank"] == 0 and store.data["assign.1.0"]["rank"] == 1
    assert store.data["assign.0.0"]["size"] == store.data["assign.1.0"]["size"] == 2


@pytest.mark.timeout(30)
def test_a_worker_that_fails_before_init_at_start_is_planned_out() -> None:
    """At start worker 2 exits before init() (a broken host); 0 and 1 have asked. Nobody has
    been answered yet, so the start is planned again without it (round 1, size 2): answered
    with the first plan, the others waited in a rendezvous for it, timed out in hvd.init()
    and failed, and the whole job with them."""
    store = _FakeStore()
    d = ElasticDriver(lambda: {"a": 2, "b": 1}, _FakeSpawner(), lambda slot: {}, store,
                      num_proc=3, min_np=1, max_np=None)
    d.hosts.update({"a": 2, "b": 1})
    d._start()
    for wid in (0, 1):
        d.ready(wid, 0)
        d._step()
    d._on_exit(2, 1, None)
    d._step()
    d._step()
    answers = [store.data.get(f"assign.{wid}.0") for wid in range(3)]
    assert answers[2] is None, answers
    assert [(a["rank"], a["size"], a["scope"]) for a in answers[:2]] == [
        (0, 2, "ringvod/elastic/1"), (1, 2, "ringvod/elastic/1")], answers
    assert d.resets == 0
    d._on_exit(0, 0, None)
    d._on_exit(1, 0, None)
    d._step()
    d._step()
    res = d._result()
    assert res.exit_code == 0 and res.final_size == 2, res.summary


def test_host_manager_order_and_cooldown() -> None:
    now = [100.0]
    hm = HostManager((2, 10), clock=lambda: now[0])
    hm.update({"a": 1, "b": 2})
    hm.update({"c": 1, "b": 2, "a": 1})  # order is first-seen, not discovery order
    assert [h.hostname for h in hm.available()] == ["a", "b", "c"]
    cooldown = hm.blacklist("b")
    assert cooldown is not None and 2 <= cooldown <= 4
    assert [h.hostname for h in hm.available()] == ["a", "c"] and hm.total_slots() == 2
    now[0] += cooldown + 0.01
    assert [h.hostname for h in hm.available()] == ["a", "b", "c"]
    second = hm.blacklist("b")  # the cooldown grows with each failure, up to the maximum
    assert second is not None and 4 <= second <= 6
    for _ in range(5):
        last = hm.blacklist("b")
    assert last == 10


def test_host_manager_permanent_blacklist_and_bad_range() -> None:
    hm = HostManager()
    hm.update({"a": 1})
    assert hm.blacklist("a") is None
    assert hm.available() == [] and hm.blacklisted() == ["a"]
    with pytest.raises(ValueError, match="1 <= MIN <= MAX <= 3600"):
        HostManager((0, 5))


def test_discovery_output() -> None:
    assert parse_discovery_output("a:2\n\nb\na:3\n", 4, "s") == {"a": 3, "b": 4}
    with pytest.raises(DiscoveryError, match="without a slot count"):
        parse_discovery_output("b\n", None, "s")
    with pytest.raises(DiscoveryError, match="expected 'hostname'"):
        parse_discovery_output("a b:1\n", 1, "s")


def test_discovery_script_failure_and_callable(tmp_path) -> None:
    with pytest.raises(DiscoveryError, match="exited with status 3: nope"):
        HostDiscoveryScript("echo nope >&2; exit 3").find_available_hosts_and_slots()
    assert HostDiscoveryScript("echo x:2").find_available_hosts_and_slots() == {"x": 2}
    assert as_discovery(lambda: {"h": 2}).find_available_hosts_and_slots() == {"h": 2}
    with pytest.raises(TypeError):
        as_discovery(3)


def _gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_discovery_script_timeout_kills_its_children(tmp_path) -> None:
    marker = tmp_path / "pids"
    script = f"sleep 100 & echo $$ $! > {marker}; wait; echo localhost:2"
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="did not finish within 1 s"):
        HostDiscoveryScript(script, timeout=1).find_available_hosts_and_slots()
    assert time.monotonic() - start < 10
    shell, child = (int(p) for p in marker.read_text().split())
    try:
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the script's `sleep` child outlived the timeout"
        assert _gone(shell)
        deadline = time.monotonic() + 5
        while True:  # the group empties once the orphaned child is reaped
            try:
                os.killpg(shell, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the script's process group still exists"
            time.sleep(0.05)
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)



@pytest.mark.parametrize("child", [
    # A child that left the script's session but is still the shell's child.
    "setsid sleep 100 & echo $! > {marker}; wait",
    # The same with its environment cleared (no run marker): only its ancestry leads to it.
    "setsid env -i sleep 100 & echo $! > {marker}; wait",
    # `setsid -f` forks: the sleeping child is orphaned at once (its parent exits), so
    # neither the process group nor the process tree leads to it.
    "setsid -f sh -c 'echo $$ > {marker}.tmp; mv {marker}.tmp {marker}; exec sleep 100'; "
    "while [ ! -e {marker} ]; do sleep 0.05; done; sleep 100",
], ids=["setsid-child", "setsid-child-no-env", "setsid-orphan"])
@pytest.mark.timeout(60)
def test_discovery_script_timeout_kills_children_in_their_own_session(tmp_path, child) -> None:
    marker = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="did not finish within 2 s"):
        HostDiscoveryScript(child.format(marker=marker),
                            timeout=2).find_available_hosts_and_slots()
    assert time.monotonic() - start < 10
    pid = int(marker.read_text())
    try:
        assert os.getsid(pid) == pid, "the child did not start a session of its own"
    except ProcessLookupError:
        pass  # already gone
    try:
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the script's child in a session of its own outlived the timeout"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)

def _args(*argv: str):
    return build_parser().parse_args([*argv, "python", "x.py"])


def test_cli_elastic_settings(monkeypatch) -> None:
    monkeypatch.delenv("HOROVOD_ELASTIC_TIMEOUT", raising=False)
    settings, el = elastic_settings_from_args(_args(
        "-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "d.sh",
        "--slots-per-host", "2", "--reset-limit", "3", "--elastic-timeout", "5",
        "--blacklist-cooldown-range", "1", "9"))
    assert settings.num_proc == 2 and settings.mode == "tcp"
    assert (el.min_np, el.max_np, el.slots_per_host, el.reset_limit) == (1, 4, 2, 3)
    assert el.elastic_timeout == 5.0 and el.cooldown_range == (1.0, 9.0)
    assert float(settings.env_overrides["HOROVOD_ELASTIC_TIMEOUT"]) == 5
    _, el = elastic_settings_from_args(_args("--min-np", "2", "-H", "a:1,b:1"))
    assert el.min_np == 2 and el.max_np is None and el.elastic_timeout == 600.0


def test_cli_elastic_timeout_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    _, el = elastic_settings_from_args(_args("--min-np", "2", "-H", "a:1,b:1"))
    assert el.elastic_timeout == 42.0
    _, el = elastic_settings_from_args(_args("--min-np", "2", "-H", "a:1,b:1",
                                             "--elastic-timeout", "7"))
    assert el.elastic_timeout == 7.0  # the flag wins


def test_cli_discovery_job_does_not_look_for_the_command_here() -> None:
    """The hosts of a discovery-script job are not known yet: they may have the command."""
    missing = "/nonexistent/ringvod-remote-train"
    args = build_parser().parse_args(["-np", "2", "--host-discovery-script", "d.sh", missing])
    settings, _ = elastic_settings_from_args(args)
    assert settings.command == (missing,)
    args = build_parser().parse_args(["-np", "2", "--min-np", "1", "-H",
                                      "localhost:1,127.0.0.1:1", missing])
    with pytest.raises(ValueError, match="cannot run"):  # fixed local hosts: checked
        elastic_settings_from_args(args)


@pytest.mark.parametrize("argv, match", [
    (("-np", "2", "--min-np", "3", "-H", "a:2,b:2"), "--min-np"),
    (("-np", "4", "--max-np", "3", "-H", "a:2,b:2"), "--max-np"),
    (("-np", "2", "--min-np", "1", "-H", "a:2"), "fewer than 2 hosts"),
    (("-np", "2", "--min-np", "1", "--mpi", "-H", "a:1,b:1"), "tcp mode"),
    (("-np", "2", "--host-discovery-script", "d", "--blacklist-cooldown-range", "0", "5"),
     r"^--blacklist-cooldown-range 0 5: need 1 <= MIN <= MAX"),  # as given, not 0.0 5.0
])
def test_cli_elastic_errors(argv, match) -> None:
    with pytest.raises(ValueError, match=match):
        elastic_settings_from_args(_args(*argv))


def test_protocol_constants_match_the_worker_side() -> None:
    import collective.elastic as worker
    from launcher.elastic import driver

    assert (driver.SCOPE, driver.WORKER_ID_ENV) == (worker.SCOPE, worker.WORKER_ID_ENV)
    assert driver.HEARTBEAT_INTERVAL_S == worker.HEARTBEAT_INTERVAL_S
    for name in ("no_update", "removed", "added", "mixed"):
        assert getattr(driver.HostUpdateResult, name) == getattr(worker.HostUpdateResult, name)


# A name for a host on another machine: resolved by the fakes below, never by DNS.
OTHER = "node2.example"
OTHER_ADDRESS = "192.0.2.77"


@pytest.fixture
def other_machine(monkeypatch):
    """OTHER resolves to OTHER_ADDRESS, which the kernel would send to from 192.0.2.2."""
    real_getaddrinfo, real_route = socket.getaddrinfo, network.route_source_address

    def getaddrinfo(host, *args, **kwargs):
        if host == OTHER:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (OTHER_ADDRESS, 0))]
        return real_getaddrinfo(host, *args, **kwargs)

    def route(host, port=9):
        return "192.0.2.2" if host == OTHER else real_route(host, port)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(network, "route_source_address", route)


def test_server_address_skips_remote_hosts_that_are_this_machine(other_machine) -> None:
    """127.0.0.2 is reached over ssh but through the loopback interface: routing to it gives
    127.0.0.1, which the machines after it could not reach."""
    assert network.choose_server_address([], ()) == "127.0.0.1"
    assert network.choose_server_address(["127.0.0.2"], ()) == "127.0.0.1"
    assert network.choose_server_address(["127.0.0.2", OTHER], ()) == "192.0.2.2"
    assert network.choose_server_address([OTHER, "127.0.0.2"], ()) == "192.0.2.2"
    assert network.choose_server_address(["127.0.0.2", OTHER], ("lo",)) == "127.0.0.1"


def test_resolves_here(other_machine) -> None:
    local = network.local_addresses()
    for name in ("localhost", "127.0.0.1", "127.0.0.2", "127.1.2.3"):
        assert network.resolves_here(name, local), name
    assert not network.resolves_here(OTHER, local)
    assert not network.resolves_here("no such host", local)


class _ScriptedDriver:
    """Stands in for ElasticDriver in run_elastic: builds the environment of one worker per
    host of `HOSTS`, in order, as the driver does before it spawns one (spawns nothing)."""

    HOSTS: list[str] = []

    def __init__(self, discovery, spawner, env_for, server, **kwargs) -> None:
        self.env_for = env_for

    def run(self, first_hosts=None) -> ElasticResult:
        for rank, host in enumerate(self.HOSTS):
            self.env_for(SlotInfo(host, rank, 0, rank, len(self.HOSTS), 1, len(self.HOSTS)))
        return ElasticResult(0, "hvdrun: elastic job finished.", final_size=len(self.HOSTS))


def _elastic_stderr(monkeypatch, first: dict[str, int], later: list[str],
                    *flags: str) -> str:
    monkeypatch.setattr(_ScriptedDriver, "HOSTS", later)
    monkeypatch.setattr("launcher.elastic.launch.ElasticDriver", _ScriptedDriver)
    settings, elastic = elastic_settings_from_args(_args(
        "-np", "1", "--min-np", "1", "--host-discovery-script", "d.sh", *flags))
    err = io.StringIO()
    result = run_elastic(settings, elastic, discovery=lambda: first, stdout=io.StringIO(),
                         stderr=err)
    assert result.exit_code == 0
    return err.getvalue()


@pytest.mark.parametrize("first", [{"127.0.0.2": 2}, {"localhost": 1, "127.0.0.2": 1}])
def test_no_warning_for_loopback_hosts_over_ssh(monkeypatch, other_machine, first) -> None:
    """Hosts such as 127.0.0.2 go over ssh, yet they are this machine and reach 127.0.0.1."""
    err = _elastic_stderr(monkeypatch, first, ["127.0.0.2", "127.0.0.2", "127.0.0.3"])
    assert "warning" not in err, err


@pytest.mark.parametrize("first", [{"localhost": 2}, {"127.0.0.2": 2}])
def test_warning_once_for_another_machine_after_a_loopback_start(
        monkeypatch, other_machine, first) -> None:
    err = _elastic_stderr(monkeypatch, first, ["127.0.0.2", OTHER, OTHER, "127.0.0.3"])
    lines = [line for line in err.splitlines() if "warning" in line]
    assert lines == [
        f"hvdrun: warning: host {OTHER} is not this machine, but the rendezvous server "
        f"listens on 127.0.0.1 (chosen at start because every host found then "
        f"({', '.join(first)}) was this machine); workers on {OTHER} cannot connect to it. "
        "Start hvdrun with --network-interface naming an interface that the other machines "
        "can reach."], err


def test_warning_names_the_loopback_network_interface(monkeypatch, other_machine) -> None:
    err = _elastic_stderr(monkeypatch, {"localhost": 1}, [OTHER], "--network-interface", "lo")
    assert "listens on 127.0.0.1 (the address of --network-interface lo)" in err, err


def test_unreachable_server_warning_cases(other_machine) -> None:
    local = network.local_addresses()
    assert unreachable_server_warning(OTHER, "192.0.2.2", ["127.0.0.2", OTHER], (), local) is None
    assert unreachable_server_warning("127.0.0.2", "127.0.0.1", ["localhost"], (), local) is None
    text = unreachable_server_warning(OTHER, "127.0.0.1", [], (), local)
    assert text is not None and "when the discovery had found no host" in text
