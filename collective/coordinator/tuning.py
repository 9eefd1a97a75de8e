"""Autotune's place in the coordinator: the parameters in force and the switch between them.

`collective.autotune` searches; this holds what every rank applies (fusion threshold, cycle
time, response cache, `DistributedOptimizer` bucket size) and moves rank 0's new values to
every rank at a negotiation round they all share:

* each round of the global set (`wants_retune`) counts in `rounds`; global rank 0 clears the
  round's inverted retune status bit while its tuner has new parameters (`Driver.pending`);
* a round whose AND has the bit clear broadcasts them (`retune`) on every rank, after the
  invalid-bit exchange and before the round's fusion plan, so the plan of that round and
  every later one uses the new threshold everywhere;
* the execute path feeds each executed allreduce of the global set to the tuner (`driver`,
  None on every other rank and once tuning ended: one attribute check per op).

**Response cache.** Every rank must hold the same cache entries under the same bit numbers, and
a round's word vector has as many bits as the cache, so the cache switches at a round boundary
that every rank shares. The retune round itself finishes with the old setting (the hits it
agreed on run from the cache, its slow path fills the cache or not as before); then
`sync_cache` applies the new one to the global set: off = every rank drops every entry (so the
numbering stays equal: none), and requests that were waiting as cache hits go back to the slow
path next round (`ps.carry`), as when a join suspends the cache; on = an empty cache with the
configured capacity, filled by later slow paths the same way everywhere. Another process set
switches at the start of its next round: every rank runs one round of every set it belongs to
per cycle, the global set's included, so that is the same round of that set on all of its
members. The express lane (fastpath.py) needs no change: it only runs on a cache hit, and an
empty cache has none.

**Bucket size.** `DistributedOptimizer` reduces its gradients in buckets whose names and sizes
must be the same on every rank in every step, so a new bucket size must apply from the same
optimizer step everywhere. A negotiation round is shared, but where each rank's training loop
stands at that round is not: one rank may already have passed its step's `synchronize()` while
another has not. So a bucket size is announced with a step number. The optimizer registers a
`BucketSchedule` (`register_buckets`, through `collective.adapter.bucket_schedule`) and counts
its completed `synchronize()` calls in it (`step_done`); when rank 0 publishes a new size it
reads its own count c and announces `bucket_from_step` S = c + 2; every rank appends (S, size) to
`bucket_plan`, and each optimizer, at the end of its k-th `synchronize()`, re-plans its buckets
to the size of the last announcement with S <= k. All ranks agree because every rank has the
announcement before it ends synchronize number S: ending it needs rank 0's requests of step S,
which rank 0 submits only after its synchronize number S - 1 ended, i.e. after it read
c <= S - 2 at the retune round; so those requests, and the round that completes the step on any
rank, come after the retune round, which every rank applies first. (Announcements are never
overwritten, only appended, so a rank that is a step behind still passes through every size.)
Rank 0's driver discards samples until its own optimizer has passed S; if that takes longer
than a bound (the optimizer kept but no longer stepped: `autotune.Driver`), it stops tuning
bucket sizes as if the optimizer were gone (below), and the size stays announced: every rank
applies it after step S if the optimizer steps again. Bucket sizes are tuned only for the
first bucketed optimizer of the global set registered with this runtime; a second one keeps
the configured size (its `register_buckets` returns None) and, if the bucket stage has not
begun, the stage is skipped (once it has begun, it and the final choice still apply to the
first optimizer only). Sizes are not tuned at all in elastic jobs (a new worker would
plan its buckets from the configuration), and they are held from a join on: a joined rank
stops counting steps, so from the first round in which a rank has joined the sizes are held
and an announcement that no rank has applied yet is withdrawn (`on_join`).

**The tuned optimizer dropped.** The schedule is closed by a finalizer of its owner (the
optimizer's reducer, `weakref.finalize`) when that is garbage-collected; `close` only sets a
flag, as it may run on any thread. Rank 0's driver sees it through `optimizer_steps` (None from
then on) at its next sample or while it waits for a switch to take effect: it stops waiting,
discards the sample and ends the bucket stage (`Autotuner.drop_buckets`); its next parameters
reach every rank at a shared retune round as usual, and no bucket size is announced from then
on (a rank whose own optimizer were still alive would keep the size last announced). No later
optimizer is tuned, whether or not the first one is gone on this rank: registration alone
decides, so every rank returns alike however its garbage collector runs.

**Optimizers created after tuning ended** (re-created per phase, after a checkpoint reload) plan
with the configured size, not the tuned one. Handing them the last size in force would need
every rank to know, at the optimizer's construction, that tuning has ended and which size it
ended with, and a rank does not: it learns both at a retune round, which its coordinator
thread applies whenever that round runs, unrelated to where its training thread stands (and
the optimizer's construction exchanges nothing). One rank may construct after applying the
final round and another before it, or one may have passed the step a final size was
announced for and another not; the two would plan different buckets and hang. Registration
order alone, which is the same everywhere, decides instead.
"""
from __future__ import annotations

import struct
import weakref
from typing import Any

from .. import _log, autotune
from .state import ProcessSetState

__all__ = ["BucketSchedule", "Tuning"]


class BucketSchedule:
    """The bucket sizes one `DistributedOptimizer` uses, step by step (see the module
    docstring). The optimizer calls `step_done()` at the end of every `synchronize()`."""

    def __init__(self, tuning: Tuning, cap_mb: float) -> None:
        self._tuning = tuning
        self.initial = cap_mb
        self.steps = 0  # synchronize() calls completed (read by rank 0's coordinator thread)
        self.closed = False  # the optimizer is gone (`close`): no step will be counted again

    def close(self) -> None:
        """The optimizer that counts its steps here is gone (called by a finalizer of its owner,
        on whatever thread drops it, so this only sets a flag; rank 0's driver reads it)."""
        self.closed = True

    def cap_at(self, steps: int) -> float:
        """The bucket size in force after `steps` completed synchronize() calls."""
        plan = self._tuning.bucket_plan
        for i in range(len(plan) - 1, -1, -1):
            if plan[i][0] <= steps:
                return plan[i][1]
        return self.initial

    def step_done(self) -> float:
        """Counts one completed synchronize(); returns the bucket size of the next step."""
        self.steps += 1
        return self.cap_at(self.steps)


class Tuning:
    """The tunable parameters of one coordinator, shared by its negotiator, loop and execute
    path."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.fusion_threshold: int = config.fusion_threshold  # bytes
        self.cycle_time: float = config.cycle_time  # seconds
        self.cache_capacity: int = config.cache_capacity  # what every set's cache uses now
        self.driver: autotune.Driver | None = None  # global rank 0 while autotune runs
        self.rounds = 0  # negotiation rounds of the global set
        self.retunes: list[tuple[int, autotune.Params]] = []  # (round, parameters applied)
        # (optimizer step count S, bucket size in MB): the size in force after step S
        self.bucket_plan: list[tuple[int, float]] = []
        self.schedule: BucketSchedule | None = None  # the optimizer whose buckets are tuned
        self.buckets_held = False  # bucket size held fixed: a second optimizer, or a join
        self.join_seen = False  # a rank of the global set has joined (`on_join`)

    def start(self, rank: int) -> None:
        """At the coordinator's start: global rank 0 creates the tuner when autotune is on."""
        if self.config.autotune and rank == 0:
            self.driver = autotune.from_config(self.config, self.buckets_ready)

    def close(self) -> None:
        """The coordinator's loop has ended: closes rank 0's CSV log if tuning had not ended
        (once it has, the tuner closed it and `driver` is None). Nothing records after the
        loop's end: every rank agreed on the shutdown or the control plane was aborted."""
        driver = self.driver
        if driver is not None:
            try:
                driver.close()
            except OSError as exc:
                _log.get_logger().warning("autotune: closing the log failed: %s", exc)

    def buckets_ready(self) -> bool:
        """Whether a bucketed optimizer's bucket size may be tuned (rank 0's tuner asks)."""
        return (self.schedule is not None and not self.schedule.closed
                and not self.buckets_held)

    def register_buckets(self, cap_mb: float, global_set: bool,
                         owner: Any = None) -> BucketSchedule | None:
        """A `DistributedOptimizer` planned buckets of `cap_mb` MB: its schedule when autotune
        may change the size, else None (it keeps `cap_mb`). Every rank registers the same
        optimizers in the same order, so every rank returns alike. `owner`: the object that
        counts the steps (the optimizer's reducer); when it is garbage-collected the schedule
        closes (see the module docstring)."""
        cfg = self.config
        if not cfg.autotune or cfg.elastic or cap_mb <= 0 or not global_set:
            return None
        if self.schedule is not None:  # a second one (or a later one after the first was
            # dropped): sizes stay as they are from now on
            self.buckets_held = True
            if self.driver is not None:
                self.driver.settle = False
            return None
        schedule = BucketSchedule(self, cap_mb)
        if owner is not None:
            weakref.finalize(owner, schedule.close).atexit = False
        if self.driver is not None:  # before the schedule is visible to rank 0's tuner, so
            # it never has a bucket size to publish without a step count
            self.driver.optimizer_steps = lambda: None if schedule.closed else schedule.steps
        if self.join_seen:
            self.buckets_held = True  # registered after a join: not tuned (see on_join)
        self.schedule = schedule
        return schedule

    def on_join(self, ps: ProcessSetState) -> None:
        """The first negotiation round of the global set in which a rank has joined; every
        rank runs it (the slow path's broadcast carries the join flag). From here the ranks'
        optimizer step counts differ for good (a joined rank runs the others' steps with
        zeros, without counting them), so step numbers cannot name a common step any more:
        bucket sizes are held from now on (rank 0's tuner ends its bucket stage and announces
        none), and an announced size that no rank has applied yet is withdrawn on every rank.

        Why that is consistent: the joined rank completed its last step, number M, and no
        rank can complete step M + 1 before this round (its allreduces need the joined rank,
        whose zeros only this round allows), while every rank is at M - 1 or later (step M's
        allreduces needed all of them). So M is the largest count of any rank now: sizes
        announced for a step S <= M apply on every rank after step S (some already did), and
        sizes for S > M apply nowhere."""
        if self.join_seen or not self.config.autotune:
            return
        self.join_seen = True
        self.buckets_held = True
        schedule = self.schedule
        mine = schedule.steps if schedule is not None else 0
        top = max(struct.unpack("<q", b)[0] for b in ps.control.allgather(struct.pack("<q", mine)))
        kept = [(at, cap) for at, cap in self.bucket_plan if at <= top]
        if len(kept) != len(self.bucket_plan):
            _log.get_logger().info(
                "autotune: a rank joined before the bucket size announced for step %d took "
                "effect; the size in force stays", self.bucket_plan[-1][0])
        self.bucket_plan = kept  # one assignment: the training thread reads the list
        if self.driver is not None:
            self.driver.hold_buckets()

    def wants_retune(self, ps: ProcessSetState) -> bool:
        """Called once per negotiation round, just before its AND allreduce: True when this
        rank clears the round's retune bit (global rank 0 with new parameters, set 0 only)."""
        if ps.id != 0:
            return False
        self.rounds += 1
        return self.driver is not None and self.driver.pending

    def retune(self, ps: ProcessSetState) -> None:
        """Global rank 0's parameters, broadcast over `ps` (the global set) and applied on
        every rank (whether or not this rank has a tuner). The cache setting takes effect at
        the end of this round (`sync_cache`, called by the negotiator)."""
        driver = self.driver
        data = ps.control.bcast(driver.publish() if driver is not None else None)
        p = autotune.Params.decode(data)
        self.fusion_threshold = p.fusion_threshold
        self.cycle_time = max(p.cycle_time_ms, 0.0) / 1000.0
        self.cache_capacity = self.config.cache_capacity if p.cache_enabled else 0
        if p.bucket_from_step > 0:
            self.bucket_plan.append((p.bucket_from_step, p.bucket_cap_mb))
        self.retunes.append((self.rounds, p))
        if not p.active:
            self.driver = None  # tuning ended: these values stay
        _log.trace("autotune: round %d: fusion threshold %d, cycle time %g ms, cache %s, "
                   "bucket %g MB from step %d", self.rounds, p.fusion_threshold,
                   p.cycle_time_ms, p.cache_enabled, p.bucket_cap_mb, p.bucket_from_step)

    def sync_cache(self, ps: ProcessSetState) -> None:
        """Applies the cache setting in force to `ps` between two of its rounds (every rank of
        the set at the same one: see the module docstring)."""
        want = self.cache_capacity
        if ps.cache.capacity == want:
            return
        if want == 0:
            ps.carry.extend(ps.hits.drain())  # waiting hits go to the slow path next round
            ps.cache.clear()
        ps.cache.capacity = want
