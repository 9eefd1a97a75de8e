"""Autotune (`HOROVOD_AUTOTUNE=1`): searches the fusion threshold and cycle time for the highest
allreduce throughput while training runs.

Only global rank 0 tunes; the coordinator broadcasts each new parameter set to every rank at a
negotiation round all ranks share, so every rank switches at the same round (see
collective/coordinator/tuning.py). This module has no threads and no I/O other than the CSV log:

* `Sampler` turns executed allreduce responses into throughput samples. A sample closes when
  some tensor name has been reduced `steps_per_sample` times since the sample began (one
  training step reduces every gradient once), as Horovod does.
* `Autotuner` takes samples (`add_sample(bytes, seconds)`) and proposes parameters. The median
  of `samples_per_eval` samples is the score of one parameter set (bytes reduced per
  microsecond, as Horovod's log); the first `warmup_samples` scores, taken at the starting
  values, are discarded.

The search (Horovod uses Bayesian optimisation over the same two knobs; this coordinate search
over the same ranges takes no more evaluations and is deterministic):

1. the fusion threshold over 0 and 1 to 64 MB in powers of two (the starting value included),
   at the starting cycle time;
2. the cycle time over 1 to 100 ms, log-spaced, at the best threshold so far;
3. the best `confirm` candidates measured once more; the highest mean score wins.

At most `max_samples` parameter sets are scored (`HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`); the
cycle-time stage is shortened to fit. A knob set through the environment or `hvdrun` is held
fixed, as in Horovod. When the search ends the best values stay in force, are logged and end the
CSV log.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TextIO

from . import _log
from .config import Config, options_by_field

__all__ = ["Autotuner", "Sampler", "Driver", "from_config", "Params", "CSV_HEADER",
           "THRESHOLD_GRID_MB", "CYCLE_GRID_MS"]

_MB = 1024 * 1024
THRESHOLD_GRID_MB = (0, 1, 2, 4, 8, 16, 32, 64)
CYCLE_GRID_MS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
CSV_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
              "cycle_time_ms,tensor_fusion_threshold,score")
_WIRE = struct.Struct("<qd?")  # fusion threshold (bytes), cycle time (ms), tuning still active


@dataclass(frozen=True)
class Params:
    """One parameter set: what every rank applies."""
    fusion_threshold: int  # bytes
    cycle_time_ms: float
    active: bool = True  # False once tuning has ended (these are the final values)

    def encode(self) -> bytes:
        return _WIRE.pack(int(self.fusion_threshold), float(self.cycle_time_ms), self.active)

    @staticmethod
    def decode(data: bytes) -> "Params":
        threshold, cycle, active = _WIRE.unpack(data)
        return Params(threshold, cycle, active)


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
    """Rank 0's search. Feed `add_sample(bytes, seconds)`; read `params` after it returns True."""

    def __init__(self, fusion_threshold: int, cycle_time_ms: float, *, warmup_samples: int = 3,
                 max_samples: int = 20, samples_per_eval: int = 5, confirm: int = 3,
                 tune_threshold: bool = True, tune_cycle_time: bool = True,
                 log: TextIO | None = None, flags: tuple[bool, bool, bool, bool] = (
                     False, False, False, True)) -> None:
        self.start = Params(int(fusion_threshold), float(cycle_time_ms))
        self.params = self.start
        self.warmup_left = max(int(warmup_samples), 0)
        self.max_samples = max(int(max_samples), 1)
        self.samples_per_eval = max(int(samples_per_eval), 1)
        self.confirm = max(int(confirm), 0)
        self.tune_threshold = tune_threshold
        self.tune_cycle_time = tune_cycle_time
        self._log = log
        self._flags = flags  # hierarchical allreduce/allgather, torus, cache (CSV columns)
        self._window: list[float] = []
        self.scores: dict[tuple[int, float], list[float]] = {}  # scores per parameter set
        self.history: list[tuple[Params, float]] = []  # every scored set in order
        self.evaluations = 0
        self._stage = 0
        self._queue: list[tuple[int, float]] = []
        if log is not None:
            log.write(CSV_HEADER + "\n")
            log.flush()
        self.active = tune_threshold or tune_cycle_time
        if self.active:
            self._queue = self._threshold_stage()
        else:
            self.params = Params(self.start.fusion_threshold, self.start.cycle_time_ms, False)

    # -- the search ---------------------------------------------------------------------------
    def _threshold_stage(self) -> list[tuple[int, float]]:
        cyc = self.start.cycle_time_ms
        if not self.tune_threshold:
            return [(self.start.fusion_threshold, cyc)]
        grid = {mb * _MB for mb in THRESHOLD_GRID_MB} | {self.start.fusion_threshold}
        # The starting value first: it is what the warm-up measured.
        rest = sorted(grid - {self.start.fusion_threshold})
        return [(self.start.fusion_threshold, cyc)] + [(t, cyc) for t in rest]

    def _cycle_stage(self) -> list[tuple[int, float]]:
        if not self.tune_cycle_time:
            return []
        best = self._best()[0]
        grid = [c for c in CYCLE_GRID_MS if (best, c) not in self.scores]
        room = self.max_samples - self.evaluations - self.confirm
        return [(best, c) for c in grid[:max(room, 0)]]

    def _confirm_stage(self) -> list[tuple[int, float]]:
        ranked = sorted(self.scores, key=lambda k: -_mean(self.scores[k]))
        room = self.max_samples - self.evaluations
        return ranked[:max(min(self.confirm, room), 0)] if len(ranked) > 1 else []

    def _best(self) -> tuple[int, float]:
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
        key = (self.params.fusion_threshold, self.params.cycle_time_ms)
        self.scores.setdefault(key, []).append(score)
        self.history.append((self.params, score))
        self.evaluations += 1
        self._write(self.params, score)
        _log.get_logger().debug("Autotuner: fusion threshold %.2f MB, cycle time %g ms: "
                                "%.1f bytes/us", key[0] / _MB, key[1], score)
        if self._queue and self._queue[0] == key:
            self._queue.pop(0)
        while not self._queue and self._stage < 2 and self.evaluations < self.max_samples:
            self._stage += 1
            self._queue = self._cycle_stage() if self._stage == 1 else self._confirm_stage()
        if not self._queue or self.evaluations >= self.max_samples:
            return self._finish()
        nxt = Params(self._queue[0][0], self._queue[0][1])
        changed = nxt != self.params
        self.params = nxt
        return changed

    def _finish(self) -> bool:
        threshold, cycle = self._best()
        score = _mean(self.scores[(threshold, cycle)])
        self.active = False
        self.params = Params(threshold, cycle, False)
        self._write(self.params, score)
        if self._log is not None:
            self._log.close()
            self._log = None
        _log.get_logger().info(
            "Autotuner: done after %d scored parameter sets: HOROVOD_FUSION_THRESHOLD=%d "
            "(%.2f MB), HOROVOD_CYCLE_TIME=%g ms, %.1f bytes/us (starting values %.2f MB, "
            "%g ms: %s)", self.evaluations, threshold, threshold / _MB, cycle, score,
            self.start.fusion_threshold / _MB, self.start.cycle_time_ms,
            _fmt(self.scores.get((self.start.fusion_threshold, self.start.cycle_time_ms))))
        return True

    def _write(self, p: Params, score: float) -> None:
        if self._log is None:
            return
        h, g, t, c = (int(x) for x in self._flags)
        self._log.write(f"{h},{g},{t},{c},{p.cycle_time_ms:g},"
                        f"{p.fusion_threshold / _MB:g},{score:.6g}\n")
        self._log.flush()


class Driver:
    """Rank 0's glue for the coordinator: `record` each executed allreduce of the global set;
    while `pending`, the coordinator asks every rank for a parameter broadcast and sends
    `publish()`."""

    def __init__(self, tuner: Autotuner, steps_per_sample: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tuner = tuner
        self.sampler = Sampler(steps_per_sample)
        self.clock = clock
        self.pending = not tuner.active  # nothing to tune: publish the fixed values at once

    def record(self, names: Iterable[str], nbytes: int) -> None:
        sample = self.sampler.add(names, nbytes, self.clock())
        if sample is not None and self.tuner.add_sample(*sample):
            self.pending = True

    def publish(self) -> bytes:
        """The parameters to broadcast now; the next sample starts now."""
        self.pending = False
        self.sampler.reset(self.clock())
        return self.tuner.params.encode()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _fmt(xs: list[float] | None) -> str:
    return "not scored" if not xs else f"{_mean(xs):.1f} bytes/us"


def from_config(config: Config) -> Driver:
    """Rank 0's tuner for a Config. A knob whose value differs from its default was set by the
    user and is held fixed."""
    defaults = options_by_field()
    fixed = {f for f in ("fusion_threshold", "cycle_time_ms")
             if getattr(config, f) != defaults[f].default}
    log = open(config.autotune_log, "w", encoding="utf-8") if config.autotune_log else None
    tuner = Autotuner(config.fusion_threshold, config.cycle_time_ms,
                      warmup_samples=config.autotune_warmup_samples,
                      max_samples=config.autotune_bayes_opt_max_samples,
                      tune_threshold="fusion_threshold" not in fixed,
                      tune_cycle_time="cycle_time_ms" not in fixed, log=log,
                      flags=(config.hierarchical_allreduce, config.hierarchical_allgather,
                             config.torus_allreduce, config.cache_capacity > 0))
    return Driver(tuner, config.autotune_steps_per_sample)
