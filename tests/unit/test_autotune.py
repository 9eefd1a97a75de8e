"""Autotune's search (collective/autotune.py) fed synthetic throughput samples."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest

from collective.autotune import (BUCKET_GRID_MB, CSV_HEADER, CYCLE_GRID_MS, THRESHOLD_GRID_MB,
                                 Autotuner, Driver, Params, Sampler, from_config)
from collective.config import read_env
from collective.coordinator.tuning import BucketSchedule, Tuning

MB = 1024 * 1024


def throughput(threshold: int, cycle_ms: float) -> float:
    """Synthetic bytes/us: best at 8 MB and 5 ms, smooth in log space."""
    t = math.log2(threshold / MB + 0.25)
    c = math.log10(cycle_ms)
    return 1000.0 * math.exp(-0.3 * (t - 3) ** 2 - 0.8 * (c - math.log10(5)) ** 2)


def throughput4(p: Params) -> float:
    """Synthetic bytes/us over all four knobs: `throughput`, best bucket 4 MB (1 MB: -18 %),
    the cache worth 10 %."""
    bucket = math.exp(-0.05 * (math.log2(p.bucket_cap_mb) - 2) ** 2)
    return (throughput(p.fusion_threshold, p.cycle_time_ms) * bucket
            * (1.0 if p.cache_enabled else 0.9))


def run(tuner: Autotuner, rng: np.random.Generator, noise: float,
        limit: int = 10_000, model=None) -> int:
    """Feeds samples (1e6 bytes each) until tuning ends; returns the samples used."""
    n = 0
    while tuner.active and n < limit:
        p = tuner.params
        score = (model(p) if model is not None
                 else throughput(p.fusion_threshold, p.cycle_time_ms))
        score *= 1 + noise * rng.standard_normal()
        tuner.add_sample(1e6, 1e6 / max(score, 1e-3) / 1e6)
        n += 1
    return n


def best_on_grid() -> float:
    return max(throughput(mb * MB, c) for mb in THRESHOLD_GRID_MB for c in CYCLE_GRID_MS)


@pytest.mark.parametrize("seed", range(10))
def test_converges_to_the_best_within_the_stated_samples(seed):
    rng = np.random.default_rng(seed)
    # The two knobs of the original search (no optimizer: no bucket stage; cache held).
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=3, max_samples=20, tune_cache=False)
    used = run(tuner, rng, noise=0.1)
    # warm-up + at most max_samples scored settings, 5 samples each
    assert used <= (3 + 20) * 5
    p = tuner.params
    assert not p.active
    assert throughput(p.fusion_threshold, p.cycle_time_ms) >= 0.95 * best_on_grid(), p


def test_warmup_scores_are_discarded():
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=2, samples_per_eval=5)
    for _ in range(2 * 5):  # two warm-up scores: huge throughput, then thrown away
        assert tuner.add_sample(1e12, 1.0) is False
    assert tuner.evaluations == 0 and tuner.scores == {}
    assert tuner.params == Params(128 * MB, 1.0)
    for _ in range(5):
        tuner.add_sample(1e6, 1.0)
    assert tuner.evaluations == 1
    # 1e6 bytes per second = 1 byte/us
    assert tuner.scores == {(128 * MB, 1.0, 25.0, True): [1.0]}
    assert tuner.params.fusion_threshold != 128 * MB  # moved on to the next threshold


def test_score_is_the_median_of_a_window():
    tuner = Autotuner(4 * MB, 1.0, warmup_samples=0, samples_per_eval=5)
    for bps in (1e6, 9e9, 2e6, 3e6, 0.0):  # an outlier either way does not move the median
        tuner.add_sample(bps, 1.0)
    assert tuner.scores[(4 * MB, 1.0, 25.0, True)] == [2.0]


def test_fixed_knobs_are_not_tuned():
    rng = np.random.default_rng(0)
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_threshold=False)
    run(tuner, rng, noise=0.0)
    assert {k[0] for k in tuner.scores} == {4 * MB}
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_cycle_time=False)
    run(tuner, rng, noise=0.0)
    assert {k[1] for k in tuner.scores} == {5.0}
    assert tuner.params == Params(8 * MB, 5.0, False)
    nothing = Autotuner(4 * MB, 5.0, tune_threshold=False, tune_cycle_time=False,
                        tune_cache=False, tune_bucket=False)
    assert not nothing.active and nothing.params == Params(4 * MB, 5.0, False)
    # Only the cache may change: the starting values, then the cache off, then confirmations.
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_threshold=False,
                      tune_cycle_time=False, tune_bucket=False)
    run(tuner, rng, noise=0.0, model=throughput4)
    assert set(tuner.scores) == {(4 * MB, 5.0, 25.0, True), (4 * MB, 5.0, 25.0, False)}
    assert tuner.params == Params(4 * MB, 5.0, False, 25.0, True)
    # The bucket size is held when the optimizer's is fixed, even with an optimizer.
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_bucket=False,
                      buckets_ready=lambda: True)
    run(tuner, rng, noise=0.0, model=throughput4)
    assert {k[2] for k in tuner.scores} == {25.0}


def test_knobs_set_to_their_default_are_held_fixed_too():
    """Horovod holds a knob fixed when its variable is set, whatever the value: a job that pins
    HOROVOD_CYCLE_TIME=1 (the default) next to HOROVOD_AUTOTUNE=1 keeps a 1 ms cycle."""
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "1",
                              "HOROVOD_FUSION_THRESHOLD": str(128 * MB),
                              "HOROVOD_CACHE_CAPACITY": "1024",
                              "HOROVOD_BUCKET_CAP_MB": "25"}))
    t = d.tuner
    assert not (t.tune_cycle_time or t.tune_threshold or t.tune_cache or t.tune_bucket)
    assert not t.active and t.params == Params(128 * MB, 1.0, False, 25.0, True)
    # An empty variable counts as unset (ringvod reads it as the default); a keyword
    # override counts as set.
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": ""}))
    assert d.tuner.tune_cycle_time and d.tuner.tune_threshold
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1"}, cycle_time_ms=1.0))
    assert not d.tuner.tune_cycle_time and d.tuner.tune_threshold


def test_from_config_holds_user_set_knobs_fixed(tmp_path):
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "5"}))
    assert d.tuner.tune_threshold and not d.tuner.tune_cycle_time
    assert d.tuner.tune_cache and d.tuner.tune_bucket
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CACHE_CAPACITY": "0",
                              "HOROVOD_BUCKET_CAP_MB": "8"}))
    assert not d.tuner.tune_cache and not d.tuner.tune_bucket
    assert d.tuner.start.cache_enabled is False and d.tuner.start.bucket_cap_mb == 8.0
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CACHE_CAPACITY": "64"}))
    assert not d.tuner.tune_cache and d.tuner.start.cache_enabled
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_ELASTIC": "1"}))
    assert not d.tuner.tune_bucket  # a new worker would plan buckets from the configuration
    log = tmp_path / "at.csv"
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                              "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "7"}))
    assert d.tuner.warmup_left == 7 and d.tuner.tune_cycle_time
    assert log.read_text() == CSV_HEADER + "\n"
    d.close()  # the job stops before tuning ends (the coordinator's loop: Tuning.close)
    assert d.tuner._log is None and log.read_text() == CSV_HEADER + "\n"


class _Lines:
    """Stands in for the `horovod` logger (which does not propagate to caplog's root)."""

    def __init__(self):
        self.lines = []

    def __call__(self):
        return self

    def error(self, msg, *args):
        self.lines.append(msg % args)

    debug = info = warning = error


def test_a_log_that_cannot_be_created_is_an_error_line_not_an_exception(tmp_path, monkeypatch):
    # Raising here failed init() on rank 0 alone, after the world had formed: in MPI mode the
    # other ranks then waited in the coordinator's first round for ever.
    from collective import _log
    lines = _Lines()
    monkeypatch.setattr(_log, "get_logger", lines)
    path = tmp_path / "no-such-dir" / "at.csv"
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(path)}))
    assert d.tuner.active and d.tuner._log is None and not path.exists()
    (line,) = lines.lines
    assert line.startswith(f"HOROVOD_AUTOTUNE_LOG={path}: cannot create the autotune log")


def test_a_log_write_that_fails_drops_the_log_and_tuning_goes_on(monkeypatch):
    from collective import _log
    lines = _Lines()
    monkeypatch.setattr(_log, "get_logger", lines)

    class Full(io.StringIO):
        def write(self, text):
            if text != CSV_HEADER + "\n":
                raise OSError(28, "No space left on device")
            return super().write(text)

    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, max_samples=20, log=Full())
    while tuner.evaluations == 0:  # the first score: its row cannot be written
        tuner.add_sample(1e6, 0.01)
    assert tuner.active and tuner._log is None
    assert any("cannot write the log" in ln for ln in lines.lines)
    while tuner.active:
        tuner.add_sample(1e6, 0.01)


def test_a_log_whose_header_cannot_be_written_is_an_error_line(monkeypatch):
    # A full disk: the file opens, the header's write fails, at init on rank 0 alone.
    from collective import _log
    lines = _Lines()
    monkeypatch.setattr(_log, "get_logger", lines)
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/dev/full"}))
    assert d.tuner.active and d.tuner._log is None
    assert any("cannot write the log" in ln for ln in lines.lines)


def test_csv_log_is_closed_at_once_when_there_is_nothing_to_tune(tmp_path):
    log = tmp_path / "at.csv"
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                              "HOROVOD_FUSION_THRESHOLD": str(8 * MB),
                              "HOROVOD_CYCLE_TIME": "5", "HOROVOD_CACHE_CAPACITY": "64",
                              "HOROVOD_BUCKET_CAP_MB": "8"}))
    assert not d.tuner.active and d.pending
    assert d.tuner._log is None and log.read_text() == CSV_HEADER + "\n"


def test_csv_log_has_horovods_columns_and_ends_with_the_best():
    buf = io.StringIO()
    buf.close = lambda: None  # keep it readable after the tuner closes its log
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=1, max_samples=6, log=buf,
                      tune_cache=False)
    run(tuner, np.random.default_rng(1), noise=0.0)
    lines = buf.getvalue().splitlines()
    # Horovod's columns, then ringvod's bucket size
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score,"
                        "bucket_cap_mb")
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == 6 + 1  # one per scored setting, then the best
    for r in rows:
        assert len(r) == 8 and r[:4] == ["0", "0", "0", "1"] and r[7] == "25"
        float(r[4]), float(r[5]), float(r[6])
    best = max(rows[:-1], key=lambda r: float(r[6]))
    assert rows[-1] == best
    assert rows[0][4:6] == ["1", "128"]  # cycle time in ms, threshold in MB


def test_csv_log_shows_the_cache_and_bucket_size_of_each_row():
    buf = io.StringIO()
    buf.close = lambda: None
    tuner = Autotuner(8 * MB, 5.0, warmup_samples=0, log=buf, tune_threshold=False,
                      tune_cycle_time=False, buckets_ready=lambda: True)
    run(tuner, np.random.default_rng(1), noise=0.0, model=throughput4)
    rows = [line.split(",") for line in buf.getvalue().splitlines()[1:]]
    scored = {(r[3], r[7]) for r in rows[:-1]}
    assert scored == {("1", "25"), ("1", "1"), ("1", "4"), ("1", "64"), ("0", "4")}, rows
    assert rows[-1][3] == "1" and rows[-1][7] == "4"  # the best: cache on, 4 MB buckets


def test_sampler_closes_a_sample_every_steps_per_sample_steps():
    s = Sampler(steps_per_sample=3)
    names = ["a", "b", "c"]
    assert s.add(names, 100, now=0.0) is None  # starts the clock
    out = []
    t = 0.0
    for step in range(7):
        for n in names:
            t += 0.5
            r = s.add([n], 100, now=t)
            if r is not None:
                out.append(r)
    # after the first 'a' step (clock start), samples close at the 3rd next sight of a name
    assert out[0] == (100 * 7, 3.5)
    assert out == [(700, 3.5)] * 3


def test_driver_publishes_each_change_once():
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, samples_per_eval=1, max_samples=3)
    clock = iter(range(1000))
    d = Driver(tuner, steps_per_sample=1, clock=lambda: float(next(clock)))
    d.record(["g"], 10)  # clock start
    assert not d.pending
    d.record(["g"], 10)  # one step: a sample, a score, the next setting
    assert d.pending
    p = Params.decode(d.publish())
    assert not d.pending and p == tuner.params and p.active
    while tuner.active:
        d.record(["g"], 10)
        if d.pending and tuner.active:
            d.publish()
    assert Params.decode(d.publish()).active is False


def test_driver_ignores_allreduces_that_ran_before_the_broadcast():
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, samples_per_eval=1, max_samples=5)
    clock = iter(range(1000))
    d = Driver(tuner, steps_per_sample=1, clock=lambda: float(next(clock)))
    d.record(["g"], 10)
    d.record(["g"], 10)
    assert d.pending and tuner.evaluations == 1
    proposed = tuner.params
    for _ in range(5):  # still the old parameters everywhere: not samples of the new ones
        d.record(["g"], 10)
    assert tuner.evaluations == 1 and tuner.params == proposed
    assert Params.decode(d.publish()) == proposed
    d.record(["g"], 10)
    assert tuner.evaluations == 2


# -- the bucket-size and cache stages -------------------------------------------------------------
def best4() -> float:
    return max(throughput4(Params(mb * MB, c, True, b, k)) for mb in THRESHOLD_GRID_MB
               for c in CYCLE_GRID_MS for b in BUCKET_GRID_MB for k in (True, False))


def test_four_knob_search_stages_within_the_default_budget():
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, max_samples=20,
                      buckets_ready=lambda: True)
    run(tuner, np.random.default_rng(0), noise=0.0, model=throughput4)
    keys = [p.key for p, _ in tuner.history]
    assert len(keys) == tuner.evaluations == 20
    # 1. thresholds (the start first) at the starting cycle time, bucket size and cache
    assert [k[0] // MB for k in keys[:9]] == [128, 0, 1, 2, 4, 8, 16, 32, 64]
    assert {k[1:] for k in keys[:9]} == {(1.0, 25.0, True)}
    # 2. cycle times at the best threshold, shortened to leave room for the later stages
    assert keys[9:12] == [(8 * MB, c, 25.0, True) for c in (2.5, 5.0, 10.0)]
    # 3. bucket sizes at the best threshold and cycle time
    assert keys[12:15] == [(8 * MB, 5.0, b, True) for b in (1.0, 4.0, 64.0)]
    # 4. the cache off at the best so far
    assert keys[15] == (8 * MB, 5.0, 4.0, False)
    # 5. the best three again, then the starting values
    assert keys[16] == (8 * MB, 5.0, 4.0, True)
    assert keys[19] == (128 * MB, 1.0, 25.0, True)
    assert tuner.params == Params(8 * MB, 5.0, False, 4.0, True)
    assert throughput4(tuner.params) == best4()


def test_the_run_off_decides_and_the_start_is_in_it():
    # The start is scored low while the job warms up, and a few thresholds get lucky first
    # scores. The run-off measures the three best and the start again: the start, truly the
    # best, wins; 4 MB (lucky once, ranked just below the finalists) does not compete.
    lucky = {32 * MB: 104.0, 16 * MB: 103.0, 8 * MB: 102.5, 4 * MB: 102.0}
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, max_samples=20, tune_cache=False,
                      tune_cycle_time=False)

    def model(p: Params) -> float:
        first = p.key not in tuner.scores
        if p.fusion_threshold == 128 * MB:
            return 75.0 if first else 100.0
        return lucky.get(p.fusion_threshold, 95.0) if first else 95.0

    run(tuner, np.random.default_rng(0), noise=0.0, model=model)
    assert tuner.scores[(128 * MB, 1.0, 25.0, True)] == pytest.approx([75.0, 100.0])
    assert tuner.scores[(4 * MB, 1.0, 25.0, True)] == pytest.approx([102.0])  # scored once
    assert tuner.params == Params(128 * MB, 1.0, False)


@pytest.mark.parametrize("max_samples", [9, 10, 11, 20])
def test_a_small_budget_still_ends_on_the_best_found(max_samples):
    # With room for one score after the thresholds (a budget of 10), the run-off had the
    # start alone and ended on it whatever the search found.
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, max_samples=max_samples,
                      tune_cache=False, tune_cycle_time=False)
    run(tuner, np.random.default_rng(0), noise=0.0,
        model=lambda p: 100.0 if p.fusion_threshold == 8 * MB else 10.0)
    assert tuner.params.fusion_threshold == 8 * MB


def test_run_off_keeps_the_best_start_under_noise():
    # Where the starting values are best (5% above every other setting), each score is 10%
    # noisy and the start's first score reads 20% low (the job's warm-up): over 200 searches
    # the chosen setting averages 0.973 of the best (the search before the run-off: 0.950,
    # it almost never went back to the start).
    ratios = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        tuner = Autotuner(128 * MB, 1.0, warmup_samples=3, max_samples=20,
                          buckets_ready=lambda: True)
        start = tuner.start.key
        while tuner.active:
            p = tuner.params
            true = 100.0 if p.key == start else 95.0
            dip = 0.8 if tuner.evaluations == 0 else 1.0
            score = true * dip * (1 + 0.1 * rng.standard_normal())
            tuner.add_sample(1e6, 1.0 / max(score, 1e-3))
        ratios.append((100.0 if tuner.params.key == start else 95.0) / 100.0)
    assert float(np.mean(ratios)) >= 0.965, float(np.mean(ratios))


def test_closing_log_line_gives_the_scores_that_decided(monkeypatch):
    # The starting values' score in the closing line is the one the run-off compared (their
    # first score left out), not the mean of all their scores.
    from collective import _log

    lines = []

    class Logger:
        def info(self, msg, *args):
            lines.append(msg % args)

        debug = warning = info

    monkeypatch.setattr(_log, "get_logger", Logger)
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=0, max_samples=20,
                      buckets_ready=lambda: True)
    start = tuner.start.key
    while tuner.active:
        first = tuner.evaluations == 0
        score = 50.0 if first else 100.0 if tuner.params.key == start else 90.0
        tuner.add_sample(1e6, 1.0 / score)
    assert tuner.params.key == start and len(tuner.scores[start]) == 2
    (line,) = [ln for ln in lines if "Autotuner: done" in ln]
    assert line.endswith("cache on: 100.0 bytes/us)"), line


def test_each_scored_setting_is_logged_at_info_as_horovod(monkeypatch):
    # Horovod's parameter manager logs every scored setting ("Autotuner: [...] score") at INFO.
    from collective import _log

    calls = []

    class Logger:
        def __getattr__(self, level):
            return lambda msg, *args: calls.append((level, msg % args))

    monkeypatch.setattr(_log, "get_logger", Logger)
    tuner = Autotuner(4 * MB, 1.0, warmup_samples=0, samples_per_eval=1)
    tuner.add_sample(2e6, 1.0)
    assert [c for c in calls if c[1].startswith("Autotuner:")] == [
        ("info", "Autotuner: fusion threshold 4.00 MB, cycle time 1 ms, bucket 25 MB, "
                 "cache on: 2.0 bytes/us")]


def test_four_knob_search_under_noise():
    ratios = []
    for seed in range(50):
        tuner = Autotuner(128 * MB, 1.0, warmup_samples=3, max_samples=20,
                          buckets_ready=lambda: True)
        used = run(tuner, np.random.default_rng(seed), noise=0.05, model=throughput4)
        assert used <= (3 + 20) * 5 and not tuner.active
        ratios.append(throughput4(tuner.params) / best4())
    assert min(ratios) >= 0.9 and float(np.median(ratios)) == 1.0, sorted(ratios)[:5]


def test_bucket_stage_needs_an_optimizer_when_it_begins():
    asked = []
    tuner = Autotuner(8 * MB, 5.0, warmup_samples=0, tune_threshold=False,
                      tune_cycle_time=False, buckets_ready=lambda: asked.append(1) or False)
    run(tuner, np.random.default_rng(0), noise=0.0, model=throughput4)
    assert asked and {k[2] for k in tuner.scores} == {25.0}
    assert tuner.params == Params(8 * MB, 5.0, False, 25.0, True)
    # An optimizer that appears during the threshold stage is tuned.
    ready = [False]
    tuner = Autotuner(128 * MB, 5.0, warmup_samples=0, tune_cycle_time=False,
                      buckets_ready=lambda: ready[0])
    while tuner.evaluations < 3:
        tuner.add_sample(1e6, 1.0)
    ready[0] = True
    run(tuner, np.random.default_rng(0), noise=0.0, model=throughput4)
    assert {k[2] for k in tuner.scores} == {1.0, 4.0, 25.0, 64.0}


def test_cache_off_wins_when_it_scores_higher():
    tuner = Autotuner(8 * MB, 5.0, warmup_samples=0, tune_threshold=False,
                      tune_cycle_time=False, tune_bucket=False)
    run(tuner, np.random.default_rng(0), noise=0.0,
        model=lambda p: 100.0 if p.cache_enabled else 150.0)
    assert tuner.params == Params(8 * MB, 5.0, False, 25.0, False)


def test_params_wire_carries_every_knob_and_the_bucket_step():
    p = Params(3 * MB, 2.5, True, 4.0, False, bucket_from_step=17)
    q = Params.decode(p.encode())
    assert q == p and q.bucket_from_step == 17 and q.key == (3 * MB, 2.5, 4.0, False)
    assert Params(1, 1.0, bucket_from_step=5) == Params(1, 1.0)  # not part of the identity


def _bucket_driver(tune_cache: bool = True) -> tuple[Autotuner, Driver]:
    """Rank 0's driver of a tuner that searches the bucket size (and the cache, if
    `tune_cache`) from 8 MB / 5 ms, one sample per score, on a clock that ticks once a read."""
    tuner = Autotuner(8 * MB, 5.0, warmup_samples=0, samples_per_eval=1, tune_threshold=False,
                      tune_cycle_time=False, tune_cache=tune_cache, buckets_ready=lambda: True)
    clock = iter(range(10_000))
    return tuner, Driver(tuner, steps_per_sample=1, clock=lambda: float(next(clock)))


def test_driver_announces_a_bucket_size_two_steps_ahead_and_waits_for_it():
    tuner, d = _bucket_driver(tune_cache=False)
    steps = [7]
    d.optimizer_steps = lambda: steps[0]
    d.record(["b"], 10)  # clock start
    d.record(["b"], 10)  # scores 25 MB, moves to the first bucket size of the grid
    assert d.pending and tuner.params.bucket_cap_mb == 1.0
    p = Params.decode(d.publish())
    assert p.bucket_cap_mb == 1.0 and p.bucket_from_step == 7 + 2
    # Samples are discarded until this rank's optimizer has passed step 9 (three buckets,
    # each reduced once per step).
    for s in (7, 8):
        steps[0] = s
        for n in ("a", "b", "c"):
            d.record([n], 10)
    assert tuner.evaluations == 1 and not d.pending
    steps[0] = 9
    d.record(["b"], 10)  # settled: the next sample starts here
    assert tuner.evaluations == 1
    d.record(["b"], 10)
    assert tuner.evaluations == 2 and d.pending
    p = Params.decode(d.publish())
    assert p.bucket_cap_mb == 4.0 and p.bucket_from_step == 9 + 2
    # A change of another knob carries no bucket step.
    tuner.params = Params(4 * MB, 5.0, True, 4.0, True)
    assert Params.decode(d.publish()).bucket_from_step == 0


def test_bucket_schedule_applies_each_announcement_from_its_step():
    tuning = Tuning(read_env({"HOROVOD_AUTOTUNE": "1"}))
    sched = tuning.register_buckets(25.0, global_set=True)
    assert isinstance(sched, BucketSchedule)
    assert [sched.step_done() for _ in range(3)] == [25.0] * 3 and sched.steps == 3
    tuning.bucket_plan += [(5, 1.0), (7, 4.0), (7, 64.0), (9, 25.0)]
    assert [sched.cap_at(k) for k in range(3, 11)] == [25.0, 25.0, 1.0, 1.0, 64.0, 64.0,
                                                       25.0, 25.0]
    assert [sched.step_done() for _ in range(4)] == [25.0, 1.0, 1.0, 64.0]


def test_register_buckets_only_for_one_bucketed_optimizer_of_the_global_set():
    assert Tuning(read_env({})).register_buckets(25.0, True) is None  # autotune off
    on = {"HOROVOD_AUTOTUNE": "1"}
    assert Tuning(read_env({**on, "HOROVOD_ELASTIC": "1"})).register_buckets(25.0, True) is None
    tuning = Tuning(read_env(on))
    assert tuning.register_buckets(0.0, True) is None  # per-gradient mode
    assert tuning.register_buckets(25.0, False) is None  # another process set
    tuning.start(rank=0)
    assert tuning.driver is not None and not tuning.buckets_ready()
    first = tuning.register_buckets(25.0, True)
    assert first is not None and tuning.buckets_ready()
    first.step_done()
    assert tuning.driver.optimizer_steps() == 1
    # A second bucketed optimizer: bucket sizes are held from now on.
    assert tuning.register_buckets(25.0, True) is None
    assert not tuning.buckets_ready() and tuning.driver.settle is False


def test_driver_ends_the_bucket_stage_when_the_optimizer_goes_away_mid_switch():
    tuner, d = _bucket_driver()
    steps: list[int | None] = [7]
    d.optimizer_steps = lambda: steps[0]
    d.record(["b"], 10)
    d.record(["b"], 10)  # scores 25 MB, moves to 1 MB
    assert Params.decode(d.publish()).bucket_from_step == 9
    for n in ("a", "b", "c"):
        d.record([n], 10)  # waiting for step 9
    assert tuner.evaluations == 1 and not d.pending
    steps[0] = None  # the optimizer is garbage-collected before step 9
    d.record(["b"], 10)
    # 1 MB was never measured: the bucket stage ends, the cache stage starts at the best so far
    assert d.pending and tuner.params == Params(8 * MB, 5.0, True, 25.0, False)
    p = Params.decode(d.publish())
    assert p.bucket_from_step == 0 and not p.cache_enabled
    for _ in range(20):
        d.record(["b"], 10)
        if d.pending:
            p = Params.decode(d.publish())
            assert p.bucket_from_step == 0  # no bucket size is announced again
    assert not tuner.active and {k[2] for k in tuner.scores} == {25.0}


def test_driver_stops_waiting_for_an_optimizer_that_is_kept_but_no_longer_stepped():
    """The tuned optimizer stays alive but its step count never reaches the announced step
    (the job trains on with something else): after `wait_steps` steps of the job without an
    optimizer step the driver ends the bucket stage as if the optimizer were gone, announces
    no size again, and tuning ends. While the optimizer steps, the switch is waited for as
    before, however many steps of the job that takes."""
    tuner = Autotuner(8 * MB, 5.0, warmup_samples=0, samples_per_eval=2,
                      tune_threshold=False, tune_cycle_time=False,
                      buckets_ready=lambda: True)
    clock = iter(range(10_000))
    d = Driver(tuner, steps_per_sample=3, clock=lambda: float(next(clock)))
    assert d.wait_steps == 2 * 3
    steps = [7]
    d.optimizer_steps = lambda: steps[0]
    while not d.pending:
        d.record(["b", "c"], 10)  # scores 25 MB, moves to 1 MB
    assert Params.decode(d.publish()).bucket_from_step == 9
    # Below the bound between two optimizer steps: the switch takes effect, 1 MB is measured.
    for s in (7, 8):
        steps[0] = s
        for _ in range(d.wait_steps - 1):
            d.record(["b"], 10)
    assert not d.pending and d._settle_until == 9 and tuner.evaluations == 1
    steps[0] = 9
    while not d.pending:
        d.record(["b"], 10)
    assert tuner.evaluations == 2 and tuner.params.bucket_cap_mb == 4.0
    assert Params.decode(d.publish()).bucket_from_step == 11
    # The optimizer is no longer stepped: other allreduces (a fused pair, then single ones).
    d.record(["x", "y"], 10)
    for _ in range(d.wait_steps - 2):
        d.record(["x"], 10)
        assert not d.pending and d._settle_until == 11
    d.record(["y"], 10)  # not the bound yet: "x" was reduced wait_steps - 1 times
    assert not d.pending
    d.record(["x"], 10)  # the bound: the bucket stage ends, the cache stage begins
    assert d.pending and d.optimizer_steps is None and d._settle_until == 0
    assert not tuner.tune_bucket and tuner.params == Params(8 * MB, 5.0, True, 25.0, False)
    while tuner.active:
        if d.pending:
            assert Params.decode(d.publish()).bucket_from_step == 0
        d.record(["x"], 10)
    assert {k[2] for k in tuner.scores} == {25.0, 1.0} and not tuner.params.active


def test_optimizer_gone_between_samples_of_the_bucket_stage_and_before_it():
    # Gone while a bucket size is measured (its switch had taken effect): the sample in
    # progress is discarded, and the confirm stage may still go back to another bucket size
    # without announcing it.
    tuner, d = _bucket_driver(tune_cache=False)
    steps: list[int | None] = [3]
    d.optimizer_steps = lambda: steps[0]
    d.record(["b"], 10)
    d.record(["b"], 10)
    d.publish()
    steps[0] = 5
    d.record(["b"], 10)  # settled
    d.record(["b"], 10)  # scores 1 MB, moves to 4 MB
    assert tuner.evaluations == 2 and d.pending
    d.publish()
    steps[0] = 7
    d.record(["b"], 10)  # settled at 4 MB
    steps[0] = None
    d.record(["b"], 10)  # this sample closes without the optimizer: not scored
    assert tuner.evaluations == 2 and not tuner.tune_bucket
    while tuner.active:
        if d.pending:
            assert Params.decode(d.publish()).bucket_from_step == 0
        d.record(["b"], 10)
    assert {k[2] for k in tuner.scores} == {25.0, 1.0}
    # Gone before the bucket stage began: the stage is skipped.
    tuner = Autotuner(128 * MB, 5.0, warmup_samples=0, tune_cycle_time=False,
                      buckets_ready=lambda: True)
    assert tuner.drop_buckets() is False
    run(tuner, np.random.default_rng(0), noise=0.0, model=throughput4)
    assert {k[2] for k in tuner.scores} == {25.0}


def test_bucket_schedule_closes_when_its_owner_is_collected():
    import gc

    class Owner:
        pass

    tuning = Tuning(read_env({"HOROVOD_AUTOTUNE": "1"}))
    tuning.start(rank=0)
    owner = Owner()
    sched = tuning.register_buckets(25.0, True, owner=owner)
    assert sched is not None and tuning.buckets_ready()
    sched.step_done()
    assert tuning.driver.optimizer_steps() == 1
    del owner
    gc.collect()
    assert sched.closed and not tuning.buckets_ready()
    assert tuning.driver.optimizer_steps() is None
    # No later optimizer is tuned (on every rank alike, however the collector ran).
    assert tuning.register_buckets(25.0, True, owner=Owner()) is None


def test_driver_holds_bucket_sizes_after_a_join_mid_switch():
    """A rank joined while a bucket switch waited to take effect (`Tuning.on_join` withdraws
    it): the driver stops waiting, ends the bucket stage and announces no size again, while
    the optimizer is still there."""
    tuner, d = _bucket_driver()
    d.optimizer_steps = lambda: 7
    d.record(["b"], 10)
    d.record(["b"], 10)  # scores 25 MB, moves to 1 MB
    assert Params.decode(d.publish()).bucket_from_step == 9
    d.hold_buckets()
    assert d.optimizer_steps is None and d._settle_until == 0
    assert d.pending and tuner.params.bucket_cap_mb == 25.0 and not tuner.tune_bucket
    while tuner.active:
        if d.pending:
            assert Params.decode(d.publish()).bucket_from_step == 0
        d.record(["b"], 10)
    assert {k[2] for k in tuner.scores} == {25.0}


def test_tuning_on_a_join_keeps_announcements_some_rank_applied():
    """`Tuning.on_join` keeps the sizes announced for steps up to the largest step count of
    any rank (some rank applied them; the others will at the same step) and withdraws the
    later ones; optimizers registered afterwards are not tuned."""

    class Plane:
        def allgather(self, data):
            return [data, (9).to_bytes(8, "little")]  # the other rank has counted 9 steps

    class PS:
        control = Plane()

    tuning = Tuning(read_env({"HOROVOD_AUTOTUNE": "1"}))
    sched = tuning.register_buckets(25.0, True)
    for _ in range(8):
        sched.step_done()
    tuning.bucket_plan += [(5, 1.0), (9, 4.0), (10, 64.0)]
    tuning.on_join(PS())  # type: ignore[arg-type]
    assert tuning.bucket_plan == [(5, 1.0), (9, 4.0)]
    assert tuning.buckets_held and not tuning.buckets_ready()
    assert sched.step_done() == 4.0 and sched.step_done() == 4.0
    tuning.on_join(PS())  # type: ignore[arg-type]  # only the first join counts
    assert Tuning(read_env({})).register_buckets(25.0, True) is None
