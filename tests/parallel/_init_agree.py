"""SPMD script: what init() makes the ranks agree on, under real ranks (`test_init_agree.py`).

argv[1]:
* "sets-lists" / "sets-count": the last rank passes other static process sets to init() (a
  different list; none at all): every rank raises the same ValueError naming each rank's sets.
* "fusion" / "cache": rank 0 alone sets HOROVOD_FUSION_THRESHOLD=0 / HOROVOD_CACHE_CAPACITY=2:
  every rank uses rank 0's value, the others warn, and every result is right.
"""
import io
import os
import sys

import numpy as np

import collective as hvd
from collective import _current
from tests._spmd import spmd_rank
from tests.parallel._util import env_size

case = sys.argv[1]
me, n = spmd_rank(), env_size()

if case.startswith("sets-"):
    last = n - 1
    if case == "sets-lists":
        sets = [hvd.ProcessSet([last] if me == last else [0, 1])]
        shown = f"ranks {list(range(last))} passed [[0, 1]]; ranks [{last}] passed [[{last}]]"
    else:
        sets = [] if me == last else [hvd.ProcessSet([0, 1])]
        shown = f"ranks {list(range(last))} passed [[0, 1]]; ranks [{last}] passed []"
    try:
        hvd.init(process_sets=sets)
    except ValueError as exc:
        want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
                "the same process_sets to hvd.init(), in the same order.")
        assert str(exc) == want, str(exc)
    else:
        raise AssertionError(f"rank {me}: init() accepted process sets that differ across ranks")
    print(f"rank {me}: {case} ok", flush=True)
    sys.exit(0)

env, value = {"fusion": ("HOROVOD_FUSION_THRESHOLD", 0),
              "cache": ("HOROVOD_CACHE_CAPACITY", 2)}[case]
if me == 0:
    os.environ[env] = str(value)
stderr, sys.stderr = sys.stderr, io.StringIO()  # the runtime's log lines go to sys.stderr
try:
    hvd.init()
finally:
    log, sys.stderr = sys.stderr.getvalue(), stderr
sys.stderr.write(log)
field = {"HOROVOD_FUSION_THRESHOLD": "fusion_threshold",
         "HOROVOD_CACHE_CAPACITY": "cache_capacity"}[env]
assert getattr(_current.current().config, field) == value
warned = [line for line in log.splitlines() if f"{env} is " in line]
if me == 0:
    assert warned == [], warned
else:
    assert len(warned) == 1 and warned[0].endswith(
        f"but {value} on rank 0; every rank uses rank 0's value"), log
for it in range(10):
    hs = [hvd.allreduce_async(np.full(4, float(k + 100 * me), np.float32), name=f"n{k}",
                              op=hvd.Sum) for k in range(8)]
    for k, h in enumerate(hs):
        out = hvd.synchronize(h)
        want = np.full(4, float(sum(k + 100 * q for q in range(n))), np.float32)
        assert np.array_equal(out, want), (it, k, out, want)
    for k in range(8):
        out = hvd.allreduce(np.full(k + 1, float(k + 10 * me), np.float32), name=f"n{k}",
                            op=hvd.Sum)
        want = np.full(k + 1, float(sum(k + 10 * q for q in range(n))), np.float32)
        assert np.array_equal(out, want), (it, k, out, want)
hvd.shutdown()
print(f"rank {me}: {case} ok", flush=True)
