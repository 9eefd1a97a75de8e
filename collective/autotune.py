"""Autotune (`HOROVOD_AUTOTUNE=1`): searches the fusion threshold, the cycle time, the
`DistributedOptimizer` bucket size and the response cache for the highest allreduce throughput
while training runs.

Only global rank 0 tunes; the coordinator broadcasts each new parameter set to every rank at a
negotiation round all ranks share, so every rank switches at the same round (see
collective/coordinator/tuning.py, which also says how the cache and the bucket size switch
safely). This module has no threads and no I/O other than the CSV log:

* `Sampler` turns executed allreduce responses into throughput samples. A sample closes when
  some tensor name has been reduced `steps_per_sample` times since the sample began (one
  training step reduces every gradient once), as Horovod does.
* `Autotuner` takes samples (`add_sample(bytes, seconds)`) and proposes parameters. The median
  of `samples_per_eval` samples is the score of one parameter set (bytes reduced per
  microsecond, as Horovod's log); the first `warmup_samples` scores, taken at the starting
  values, are discarded.

The search (Horovod uses Bayesian optimisation over its knobs; this coordinate search over the
same ranges takes no more evaluations and is deterministic), each stage at the best values so
far:

1. the fusion threshold over 0 and 1 to 64 MB in powers of two (the starting value included),
   at the starting cycle time;
2. the cycle time over 1 to 100 ms, log-spaced;
3. the bucket size of the job's `DistributedOptimizer` over 1, 4, 25 and 64 MB (the starting
   value included), only when one optimizer of the global process set reduces its gradients in
   buckets (`buckets_ready()` says so when the stage begins; otherwise the stage is skipped);
4. the response cache on and off (the setting not yet scored);
5. a run-off: the best `confirm` candidates and the starting values measured once more; the
   highest mean score among them wins, the starting values' first score left out. The best
   first scores of many are partly luck, which a second score pulls back, so a set scored
   once does not compete with them; and the starting values are scored first of all, as the
   job's warm-up ends, so that score says little about them.

At most `max_samples` parameter sets are scored (`HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`); the
cycle-time stage is shortened to leave room for the later stages (with the default 20: the
threshold grid (9 with the default start), 3 cycle times, 3 bucket sizes, 1 cache setting, 3
confirmations and the starting values). A knob set through the environment or `hvdrun` (to
any value, its default included) is held fixed, as in Horovod; so is the bucket size of an
optimizer with `groups=`, in per-gradient mode (`HOROVOD_BUCKET_CAP_MB=0`) or over another
process set. When the search ends the best values stay in force, are logged and end the CSV
log.

The CSV log has Horovod's columns (`CSV_HEADER`: hierarchical_allreduce,
hierarchical_allgather, torus_allreduce, cache_enabled, cycle_time_ms, tensor_fusion_threshold
in MB, score) and ringvod's `bucket_cap_mb` appended as an eighth column, after `score`. It is
closed when the search ends, at once when there is nothing to tune, or when the coordinator's
loop ends first (`Tuning.close`).
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, TextIO

from . import _log
from .config import Config

__all__ = ["Autotuner", "Sampler", "Driver", "from_config", "Params", "CSV_HEADER",
           "THRESHOLD_GRID_MB", "CYCLE_GRID_MS", "BUCKET_GRID_MB"]

_MB = 1024 * 1024
THRESHOLD_GRID_MB = (0, 1, 2, 4, 8, 16, 32, 64)
CYCLE_GRID_MS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
BUCKET_GRID_MB = (1.0, 4.0, 25.0, 64.0)
# Horovod's columns, then ringvod's bucket size (an eighth column, after the score).
CSV_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
              "cycle_time_ms,tensor_fusion_threshold,score,bucket_cap_mb")
# fusion threshold (bytes), cycle time (ms), tuning still active, bucket size (MB), cache on,
# optimizer step from which the bucket size applies (0: no bucket switch in this message)
_WIRE = struct.Struct("<qd?d?q")

Key = tuple[int, float, float, bool]  # (threshold, cycle time, bucket size, cache enabled)


@dataclass(frozen=True)
class Params:
    """One parameter set: what every rank applies."""
    fusion_threshold: int  # bytes
    cycle_time_ms: float
    active: bool = True  # False once tuning has ended (these are the final values)
    bucket_cap_mb: float = 25.0  # DistributedOptimizer bucket size
    cache_enabled: bool = True  # the response cache
    # Set by rank 0's coordinator when it publishes a new bucket size: the optimizer step
    # count after which it applies on every rank (collective/coordinator/tuning.py); 0 = no
    # bucket switch. Not part of the parameter set's identity.
    bucket_from_step: int = field(default=0, compare=False)

    @property
    def key(self) -> Key:
        return (self.fusion_threshold, self.cycle_time_ms, self.bucket_cap_mb,
                self.cache_enabled)

    def encode(self) -> bytes:
        return _WIRE.pack(int(self.fusion_threshold), float(self.cycle_time_ms), self.active,
                          float(self.bucket_cap_mb), self.cache_enabled,
                          int(self.bucket_from_step))

    @staticmethod
    def decode(data: bytes) -> Params:
        threshold, cycle, active, bucket, cache, from_step = _WIRE.unpack(data)
        return Params(threshold, cycle, active, bucket, cache, from_step)

    @staticmethod
    def of(key: Key, active: bool = True) -> Params:
        return Params(key[0], key[1], active, key[2], key[3])


class Sampler:
    """Counts steps from the names of executed allreduce responses and closes samples."""

    def __init__(self, steps_per_sample: int) -> None:
        self.steps_per_sample = max(int(steps_per_sample), 1)
        self._counts: dict[str, int] = {}
        self._bytes = 0
        self._start: float | None = None

    def reset(self, now: float) -> None:
        """Starts a new sample at `now` (after a parameter change: nothing before counts)."""
        self._counts.clear()
        self._bytes = 0
        self._start = now

    def add(self, names: Iterable[str], nbytes: int, now: float) -> tuple[int, float] | None:
        """One executed allreduce response; (bytes, seconds) when it closes a sample."""
        if self._start is None:  # the clock starts at the first response: it carries no time
            self.reset(now)
            return None
        self._bytes += nbytes
        counts = self._counts
        top = 0
        for n in names:
            c = counts.get(n, 0) + 1
            counts[n] = c
            if c > top:
                top = c
        if top < self.steps_per_sample:
            return None
        sample = (self._bytes, now - self._start)
        self.reset(now)
        return sample


class Autotuner:
    """Rank 0's search. Feed `add_sample(bytes, seconds)`; read `params` after it returns True.

    `tune_*`: whether each knob may change (False: held at its starting value).
    `buckets_ready()`: asked when the bucket stage begins (and to size the earlier stages):
    whether an optimizer whose buckets may be re-planned exists; the stage is skipped if not.
    """

    def __init__(self, fusion_threshold: int, cycle_time_ms: float, *, warmup_samples: int = 3,
                 max_samples: int = 20, samples_per_eval: int = 5, confirm: int = 3,
                 tune_threshold: bool = True, tune_cycle_time: bool = True,
                 bucket_cap_mb: float = 25.0, tune_bucket: bool = True,
                 buckets_ready: Callable[[], bool] = lambda: False,
                 cache_enabled: bool = True, tune_cache: bool = True,
                 log: TextIO | None = None, flags: tuple[bool, bool, bool] = (
                     False, False, False)) -> None:
        self.start = Params(int(fusion_threshold), float(cycle_time_ms), True,
                            float(bucket_cap_mb), bool(cache_enabled))
        self.params = self.start
        self.warmup_left = max(int(warmup_samples), 0)
        self.max_samples = max(int(max_samples), 1)
        self.samples_per_eval = max(int(samples_per_eval), 1)
        self.confirm = max(int(confirm), 0)
        self.tune_threshold = tune_threshold
        self.tune_cycle_time = tune_cycle_time
        self.tune_bucket = tune_bucket and bucket_cap_mb > 0
        self.buckets_ready = buckets_ready
        self.tune_cache = tune_cache
        self._log = log
        self._flags = flags  # hierarchical allreduce/allgather, torus (CSV columns)
        self._window: list[float] = []
        self.scores: dict[Key, list[float]] = {}  # scores per parameter set
        self.history: list[tuple[Params, float]] = []  # every scored set in order
        self.evaluations = 0
        self._stage = 0
        self._queue: list[Key] = []
        self._confirmed: list[Key] = []  # the run-off's sets (the confirm stage)
        if log is not None:
            self._append(CSV_HEADER + "\n")
        self.active = tune_threshold or tune_cycle_time or self.tune_bucket or tune_cache
        if self.active:
            self._queue = self._threshold_stage()
        else:
            self.params = replace(self.start, active=False)
            self.close_log()  # nothing will be scored: the header is all the log gets

    # -- the search ---------------------------------------------------------------------------
    _LAST_STAGE = 4  # threshold, cycle time, bucket size, cache, confirm (0..4)

    def _threshold_stage(self) -> list[Key]:
        s = self.start
        if not self.tune_threshold:
            return [s.key]
        grid = {mb * _MB for mb in THRESHOLD_GRID_MB} | {s.fusion_threshold}
        # The starting value first: it is what the warm-up measured.
        rest = sorted(grid - {s.fusion_threshold})
        return [s.key] + [(t,) + s.key[1:] for t in rest]

    def _bucket_grid(self, best: Key) -> list[Key]:
        if not self.tune_bucket or not self.buckets_ready():
            return []
        grid = sorted(set(BUCKET_GRID_MB) | {self.start.bucket_cap_mb})
        keys = [(best[0], best[1], b, best[3]) for b in grid]
        return [k for k in keys if k not in self.scores]

    def _cache_grid(self, best: Key) -> list[Key]:
        if not self.tune_cache:
            return []
        key = (best[0], best[1], best[2], not best[3])
        return [] if key in self.scores else [key]

    def _cycle_stage(self) -> list[Key]:
        if not self.tune_cycle_time:
            return []
        best = self._best()
        grid = [(best[0], c, best[2], best[3]) for c in CYCLE_GRID_MS]
        grid = [k for k in grid if k not in self.scores]
        # Room for the later stages: as many bucket sizes as the grid has, one cache setting.
        later = len(self._bucket_grid(best)) + (1 if self.tune_cache else 0)
        room = self.max_samples - self.evaluations - self._kept() - later
        return grid[:max(room, 0)]

    def _bucket_stage(self) -> list[Key]:
        best = self._best()
        room = (self.max_samples - self.evaluations - self._kept()
                - (1 if self.tune_cache else 0))
        return self._bucket_grid(best)[:max(room, 0)]

    def _cache_stage(self) -> list[Key]:
        room = self.max_samples - self.evaluations - self._kept()
        return self._cache_grid(self._best())[:max(room, 0)]

    def _kept(self) -> int:
        """Evaluations the earlier stages leave for the confirm stage: `confirm`, plus one
        for the starting values."""
        return self.confirm + 1 if self.confirm else 0

    def _confirm_stage(self) -> list[Key]:
        ranked = sorted(self.scores, key=lambda k: -_mean(self.scores[k]))
        room = self.max_samples - self.evaluations
        n = max(min(self.confirm, room), 0)
        if len(ranked) <= 1 or n == 0:
            return []
        picks = ranked[:n]
        start = self.start.key
        if start in self.scores and start not in picks and room >= 2:
            # What the job runs without autotune gets a second score too (room for it was
            # kept: `_kept`), in the last pick's place if there is no room for both. With room
            # for one score only, the best set gets it: in the start's place, the run-off
            # would have the start alone and end on it whatever the search found.
            picks = picks[:min(n, room - 1)] + [start]
        self._confirmed = picks
        return list(picks)

    def _next_stage(self) -> list[Key]:
        self._stage += 1
        return (self._cycle_stage, self._bucket_stage, self._cache_stage,
                self._confirm_stage)[self._stage - 1]()

    def _best(self) -> Key:
        return max(self.scores, key=lambda k: _mean(self.scores[k]))

    # -- samples ------------------------------------------------------------------------------
    def add_sample(self, nbytes: float, seconds: float) -> bool:
        """One throughput sample at the current parameters. True when `params` changed (the
        caller publishes them to every rank)."""
        if not self.active:
            return False
        self._window.append(nbytes / max(seconds, 1e-9) / 1e6)  # bytes per microsecond
        if len(self._window) < self.samples_per_eval:
            return False
        score = sorted(self._window)[len(self._window) // 2]
        self._window = []
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return False
        return self._scored(score)

    def _scored(self, score: float) -> bool:
        key = self.params.key
        self.scores.setdefault(key, []).append(score)
        self.history.append((self.params, score))
        self.evaluations += 1
        self._write(self.params, score)
        # INFO, as Horovod's parameter manager logs each scored setting.
        _log.get_logger().info("Autotuner: fusion threshold %.2f MB, cycle time %g ms, "
                               "bucket %g MB, cache %s: %.1f bytes/us", key[0] / _MB, key[1],
                               key[2], "on" if key[3] else "off", score)
        if self._queue and self._queue[0] == key:
            self._queue.pop(0)
        return self._advance()

    def _advance(self) -> bool:
        """Moves to the next set to score (through later stages while one has none left), or
        ends the search. True when `params` changed."""
        while (not self._queue and self._stage < self._LAST_STAGE
               and self.evaluations < self.max_samples):
            self._queue = self._next_stage()
        if not self._queue or self.evaluations >= self.max_samples:
            return self._finish()
        nxt = Params.of(self._queue[0])
        changed = nxt != self.params
        self.params = nxt
        return changed

    def drop_buckets(self) -> bool:
        """The optimizer whose buckets are tuned is gone: bucket sizes are not tuned from now
        on. During the bucket stage, the set being measured is not scored and the search goes
        on with the next stage at the best values so far. True when `params` changed."""
        self.tune_bucket = False
        if not self.active or self._stage != 2:
            return False  # before the stage: it will be skipped; after it: nothing to do
        self._window = []
        self._queue = []
        return self._advance()

    def _finish(self) -> bool:
        # The sets of the run-off compete (all sets when the search ended before it).
        again = [k for k in self._confirmed if len(self.scores[k]) > 1]
        best = max(again, key=self._final_score) if again else self._best()
        score = self._final_score(best)
        self.active = False
        self.params = Params.of(best, active=False)
        self._write(self.params, score)
        self.close_log()
        s = self.start
        _log.get_logger().info(
            "Autotuner: done after %d scored parameter sets: HOROVOD_FUSION_THRESHOLD=%d "
            "(%.2f MB), HOROVOD_CYCLE_TIME=%g ms, HOROVOD_BUCKET_CAP_MB=%g%s, "
            "HOROVOD_CACHE_CAPACITY %s, %.1f bytes/us (starting values %.2f MB, %g ms, %g MB, "
            "cache %s: %s)", self.evaluations, best[0], best[0] / _MB, best[1], best[2],
            "" if any(k[2] != s.bucket_cap_mb for k in self.scores) else " (not tuned)",
            "on" if best[3] else "off (0)", score, s.fusion_threshold / _MB,
            s.cycle_time_ms, s.bucket_cap_mb, "on" if s.cache_enabled else "off",
            f"{self._final_score(s.key):.1f} bytes/us" if s.key in self.scores else "not scored")
        return True

    def _final_score(self, key: Key) -> float:
        """The mean score of `key`; for the starting values, once measured again, without
        their first score (taken first of all, as the job's warm-up ends)."""
        scores = self.scores[key]
        if key == self.start.key and len(scores) > 1:
            scores = scores[1:]
        return _mean(scores)

    def close_log(self) -> None:
        """Closes the CSV log (when the search ends, or when the job stops before it does);
        rows are flushed as they are written, so only the handle is left to close."""
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def _write(self, p: Params, score: float) -> None:
        if self._log is None:
            return
        h, g, t = (int(x) for x in self._flags)
        self._append(f"{h},{g},{t},{int(p.cache_enabled)},{p.cycle_time_ms:g},"
                     f"{p.fusion_threshold / _MB:g},{score:.6g},{p.bucket_cap_mb:g}\n")

    def _append(self, line: str) -> None:
        """Writes one line of the log. A write that fails (a full disk) must not end the job:
        it runs at init on rank 0 alone, and later on the coordinator thread. The log is then
        closed and the rest of it lost, with an error line."""
        try:
            self._log.write(line)
            self._log.flush()
        except OSError as exc:
            _log.get_logger().error("autotune: cannot write the log (%s); the rest of it is lost",
                                    exc)
            log, self._log = self._log, None
            try:
                log.close()
            except OSError:
                pass


class Driver:
    """Rank 0's glue for the coordinator: `record` each executed allreduce of the global set;
    while `pending`, the coordinator asks every rank for a parameter broadcast and sends
    `publish()`.

    Allreduces executed while new parameters wait for their broadcast (`pending`) are not
    sampled: they still ran with the old ones (and a sample closed then would move the search
    on past parameters never applied).

    `optimizer_steps`: the step count of the optimizer whose buckets are tuned (set by the
    coordinator when one registers), or None. A new bucket size is published with
    `bucket_from_step` = that count + 2 (why 2: collective/coordinator/tuning.py), and samples
    are discarded until the optimizer on this rank has passed that step (`settle`): the steps
    before it still ran with the old buckets. The callable returns None once that optimizer is
    gone (garbage-collected): the driver then stops waiting, discards the sample in progress,
    ends the bucket stage (`Autotuner.drop_buckets`) and announces no bucket size again.

    The wait is bounded (`wait_steps`): the job may keep the optimizer but stop stepping it
    (a later phase trains with another optimizer, one with `groups=`, or plain allreduces),
    and tuning must still end. The bound is counted in the unit the sampler counts in, steps
    of the job (a tensor name reduced again), so it needs no clock, and it counts only steps
    in which the optimizer completed none of its own (the count restarts whenever its step
    count moves): while it steps, each of its bucket names is reduced once per step, so the
    switch, 2 of its steps ahead, never comes near the bound. The bound is as many steps as
    one evaluation takes (`samples_per_eval` samples of `steps_per_sample` steps: 50 with the
    defaults; at least 2): a wait that long without one optimizer step means the job has moved
    on. A job that reduces one name that many times per optimizer step (e.g. a metric per
    micro-batch) would end the bucket stage early, nothing worse. When the bound is reached,
    the optimizer is treated as gone for bucket purposes (`_optimizer_gone`; its schedule
    stays open, and no size is announced any more).

    The size announced for step S stays in every rank's `bucket_plan`, and that is safe: it is
    never withdrawn on a rank that may apply it (only `Tuning.on_join` withdraws, on every rank
    at the same round, and only sizes for steps no rank has completed). Every rank had it
    before any rank completed step S (collective/coordinator/tuning.py), so if the optimizer
    steps again, every rank re-plans to that size after the same step S and keeps it (no size
    is announced after it); the driver does not wait for it, so it may fall into later
    samples. The log's final line names the best size scored, which that optimizer then does
    not use.
    """

    def __init__(self, tuner: Autotuner, steps_per_sample: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tuner = tuner
        self.sampler = Sampler(steps_per_sample)
        self.clock = clock
        self.pending = not tuner.active  # nothing to tune: publish the fixed values at once
        self.optimizer_steps: Callable[[], int] | None = None
        self.settle = True  # wait for a bucket switch to take effect before sampling
        self._bucket = tuner.start.bucket_cap_mb  # the bucket size last published
        self._settle_until = 0
        self._optimizer_lost = False  # the tuned optimizer was dropped (`_optimizer_gone`)
        # The bound on waiting for a bucket switch, in steps of the job without an optimizer
        # step (see the docstring); the steps seen since the optimizer's count last moved
        # (a sampler that closes when one name has been reduced `wait_steps` times), and
        # that count.
        self.wait_steps = max(tuner.samples_per_eval * self.sampler.steps_per_sample, 2)
        self._waited = Sampler(self.wait_steps)
        self._waited_at = 0

    def record(self, names: Iterable[str], nbytes: int) -> None:
        if self.pending:  # new parameters not yet in force: these ran with the old ones
            return
        now = self.clock()
        steps = self.optimizer_steps
        if self._settle_until:
            done = steps() if steps is not None else self._settle_until
            if done is None:  # the optimizer is gone: the switch will never take effect
                self._optimizer_gone(now)
                return
            if self.settle and done < self._settle_until:
                if done != self._waited_at:  # it stepped: count afresh
                    self._waited_at = done
                    self._waited.reset(now)
                if self._waited.add(names, nbytes, now) is not None:
                    _log.get_logger().info(
                        "autotune: the optimizer whose bucket size is tuned has not stepped in "
                        "%d steps of the job; bucket sizes are no longer tuned (if it steps "
                        "again, it uses %g MB after its step %d)", self.wait_steps,
                        self._bucket, self._settle_until)
                    self._optimizer_gone(now)
                    return
                self.sampler.reset(now)  # the old buckets are still in use somewhere
                return
            self._settle_until = 0
            self.sampler.reset(now)
            return
        sample = self.sampler.add(names, nbytes, now)
        if sample is None:
            return
        if steps is not None and steps() is None:  # gone during this sample: not scored
            self._optimizer_gone(now)
            return
        if self.tuner.add_sample(*sample):
            self.pending = True

    def hold_buckets(self) -> None:
        """A rank has joined (collective/coordinator/tuning.py: `Tuning.on_join`): bucket sizes
        are held from now on, as when the tuned optimizer is gone."""
        if self.optimizer_steps is not None or self._settle_until:
            self._optimizer_gone(self.clock())

    def _optimizer_gone(self, now: float) -> None:
        """The optimizer whose buckets are tuned was dropped (or not stepped within
        `wait_steps`): no bucket size is announced from now on and the tuner ends its bucket
        stage."""
        self.optimizer_steps = None
        self._optimizer_lost = True
        self._settle_until = 0
        self.sampler.reset(now)
        if self.tuner.drop_buckets():
            self.pending = True

    def close(self) -> None:
        """The job stops (the coordinator's loop ended) before tuning did: closes the log."""
        self.tuner.close_log()

    def publish(self) -> bytes:
        """The parameters to broadcast now; the next sample starts now."""
        self.pending = False
        now = self.clock()
        self.sampler.reset(now)
        p = self.tuner.params
        if p.bucket_cap_mb != self._bucket:
            self._bucket = p.bucket_cap_mb
            steps = self.optimizer_steps
            done = steps() if steps is not None else None
            if done is not None:
                self._settle_until = done + 2
                self._waited_at = done
                self._waited.reset(now)
                p = replace(p, bucket_from_step=self._settle_until)
            elif not self._optimizer_lost and steps is None:
                # cannot happen: the bucket stage runs only with an optimizer
                raise RuntimeError("autotune: a bucket size to publish but no optimizer")
            # else the optimizer is gone or no longer stepped (`_optimizer_gone`; if gone
            # just now, record() ends the stage at its next call): nothing is announced
        return p.encode()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _open_log(path: str) -> TextIO | None:
    """Rank 0's CSV log, or None when it cannot be created: an error line names the variable
    and tuning runs on without a log (as the timeline does at init, and as Horovod, whose
    ofstream fails silently). Raising here failed init() on rank 0 alone, after the world had
    formed: the other ranks waited in the coordinator's first round for ever (MPI mode)."""
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        _log.get_logger().error("HOROVOD_AUTOTUNE_LOG=%s: cannot create the autotune log (%s); "
                                "autotune runs without it", path, exc)
        return None


def from_config(config: Config, buckets_ready: Callable[[], bool] = lambda: False) -> Driver:
    """Rank 0's tuner for a Config. A knob the user set (its environment variable, even to the
    default value: `Config.explicit`) is held fixed. `buckets_ready`: see `Autotuner`."""
    fixed = {f for f in ("fusion_threshold", "cycle_time_ms", "bucket_cap_mb", "cache_capacity")
             if f in config.explicit}
    log = _open_log(config.autotune_log) if config.autotune_log else None
    tuner = Autotuner(config.fusion_threshold, config.cycle_time_ms,
                      warmup_samples=config.autotune_warmup_samples,
                      max_samples=config.autotune_bayes_opt_max_samples,
                      tune_threshold="fusion_threshold" not in fixed,
                      tune_cycle_time="cycle_time_ms" not in fixed,
                      bucket_cap_mb=config.bucket_cap_mb,
                      tune_bucket="bucket_cap_mb" not in fixed and not config.elastic,
                      buckets_ready=buckets_ready,
                      cache_enabled=config.cache_capacity > 0,
                      tune_cache="cache_capacity" not in fixed, log=log,
                      flags=(config.hierarchical_allreduce, config.hierarchical_allgather,
                             config.torus_allreduce))
    return Driver(tuner, config.autotune_steps_per_sample)
