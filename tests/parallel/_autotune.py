"""SPMD script: HOROVOD_AUTOTUNE=1 with one step per sample. Each step reduces many small
tensors at once (fused differently under each threshold the tuner tries); every result is checked,
and at the end every rank must have applied the same parameters at the same negotiation rounds,
and rank 0's CSV log (argv[1]) must hold Horovod's columns (plus ringvod's bucket size) with the
best setting last.
"""
import sys

import numpy as np

import collective as hvd
from collective import _current

log_path = sys.argv[1]
hvd.init()
me, n = hvd.rank(), hvd.size()
tuning = _current.current().coordinator.tuning
sizes = [256 * (i + 1) * (1 + i % 3) * 8 for i in range(24)]  # 8 KiB .. 600 KiB of float32
steps = 0
while True:
    steps += 1
    handles = [hvd.allreduce_async(np.full(s, float(me + 1 + i + steps), np.float32), op=hvd.Sum,
                                   name=f"g{i}") for i, s in enumerate(sizes)]
    for i, h in enumerate(handles):
        out = hvd.synchronize(h)
        want = sum(r + 1 + i + steps for r in range(n))
        assert out.shape == (sizes[i],) and np.all(out == want), (steps, i, out[:4], want)
    # Every rank stops at the same step: once rank 0's tuning ended (a collective decision).
    done = tuning.retunes and not tuning.retunes[-1][1].active
    if hvd.allreduce(np.array([1.0 if done else 0.0]), op=hvd.Min, name="done")[0] == 1.0:
        break
    assert steps < 400, f"autotune did not finish in {steps} steps: {tuning.retunes}"

mine = np.array([[r, p.fusion_threshold, p.cycle_time_ms, p.active] for r, p in tuning.retunes],
                np.float64)
counts = hvd.allgather(np.array([len(mine)]), name="count")
assert len(set(counts.tolist())) == 1, counts
theirs = hvd.broadcast(mine, root_rank=0, name="retunes")
assert np.array_equal(mine, theirs), (me, mine, theirs)
thresholds = {int(x) for x in mine[:, 1]}
assert len(thresholds) >= 4, thresholds  # the search really switched the fusion plan
assert mine[-1, 3] == 0 and tuning.driver is None
assert tuning.fusion_threshold == int(mine[-1, 1])
if me == 0:
    with open(log_path) as f:
        lines = f.read().splitlines()
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score,"
                        "bucket_cap_mb"), lines[0]
    rows = [[float(x) for x in line.split(",")] for line in lines[1:]]
    assert all(len(r) == 8 for r in rows) and len(rows) >= 5, rows
    assert rows[-1][5] * 1024 * 1024 == mine[-1, 1] and rows[-1][4] == mine[-1, 2], (rows, mine)
    # no DistributedOptimizer: the bucket size is not tuned
    assert {r[7] for r in rows} == {25.0}, rows
hvd.shutdown()
print(f"rank {me}: autotune ok after {steps} steps, {len(mine)} switches, final "
      f"{mine[-1, 1:3].tolist()}", flush=True)
