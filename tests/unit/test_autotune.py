"""Autotune's search (collective/autotune.py) fed synthetic throughput samples."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest

from collective.autotune import (CSV_HEADER, CYCLE_GRID_MS, THRESHOLD_GRID_MB, Autotuner, Driver,
                                 Params, Sampler, from_config)
from collective.config import read_env

MB = 1024 * 1024


def throughput(threshold: int, cycle_ms: float) -> float:
    """Synthetic bytes/us: best at 8 MB and 5 ms, smooth in log space."""
    t = math.log2(threshold / MB + 0.25)
    c = math.log10(cycle_ms)
    return 1000.0 * math.exp(-0.3 * (t - 3) ** 2 - 0.8 * (c - math.log10(5)) ** 2)


def run(tuner: Autotuner, rng: np.random.Generator, noise: float,
        limit: int = 10_000) -> int:
    """Feeds samples (1e6 bytes each) until tuning ends; returns the samples used."""
    n = 0
    while tuner.active and n < limit:
        p = tuner.params
        score = throughput(p.fusion_threshold, p.cycle_time_ms)
        score *= 1 + noise * rng.standard_normal()
        tuner.add_sample(1e6, 1e6 / max(score, 1e-3) / 1e6)
        n += 1
    return n


def best_on_grid() -> float:
    return max(throughput(mb * MB, c) for mb in THRESHOLD_GRID_MB for c in CYCLE_GRID_MS)


@pytest.mark.parametrize("seed", range(10))
def test_converges_to_the_best_within_the_stated_samples(seed):
    rng = np.random.default_rng(seed)
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=3, max_samples=20)
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
    assert tuner.scores == {(128 * MB, 1.0): [1.0]}  # 1e6 bytes per second = 1 byte/us
    assert tuner.params.fusion_threshold != 128 * MB  # moved on to the next threshold


def test_score_is_the_median_of_a_window():
    tuner = Autotuner(4 * MB, 1.0, warmup_samples=0, samples_per_eval=5)
    for bps in (1e6, 9e9, 2e6, 3e6, 0.0):  # an outlier either way does not move the median
        tuner.add_sample(bps, 1.0)
    assert tuner.scores[(4 * MB, 1.0)] == [2.0]


def test_fixed_knobs_are_not_tuned():
    rng = np.random.default_rng(0)
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_threshold=False)
    run(tuner, rng, noise=0.0)
    assert {k[0] for k in tuner.scores} == {4 * MB}
    tuner = Autotuner(4 * MB, 5.0, warmup_samples=0, tune_cycle_time=False)
    run(tuner, rng, noise=0.0)
    assert {k[1] for k in tuner.scores} == {5.0}
    assert tuner.params == Params(8 * MB, 5.0, False)
    nothing = Autotuner(4 * MB, 5.0, tune_threshold=False, tune_cycle_time=False)
    assert not nothing.active and nothing.params == Params(4 * MB, 5.0, False)


def test_from_config_holds_user_set_knobs_fixed(tmp_path):
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "5"}))
    assert d.tuner.tune_threshold and not d.tuner.tune_cycle_time
    log = tmp_path / "at.csv"
    d = from_config(read_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                              "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "7"}))
    assert d.tuner.warmup_left == 7 and d.tuner.tune_cycle_time
    assert log.read_text() == CSV_HEADER + "\n"


def test_csv_log_has_horovods_columns_and_ends_with_the_best():
    buf = io.StringIO()
    buf.close = lambda: None  # keep it readable after the tuner closes its log
    tuner = Autotuner(128 * MB, 1.0, warmup_samples=1, max_samples=6, log=buf)
    run(tuner, np.random.default_rng(1), noise=0.0)
    lines = buf.getvalue().splitlines()
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score")
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == 6 + 1  # one per scored setting, then the best
    for r in rows:
        assert len(r) == 7 and r[:4] == ["0", "0", "0", "1"]
        float(r[4]), float(r[5]), float(r[6])
    best = max(rows[:-1], key=lambda r: float(r[6]))
    assert rows[-1] == best
    assert rows[0][4:6] == ["1", "128"]  # cycle time in ms, threshold in MB


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
    assert Params.decode(d.publish()).active is False
