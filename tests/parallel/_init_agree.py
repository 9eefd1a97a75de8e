"""SPMD script: what init() makes the ranks agree on, under real ranks (`test_init_agree.py`).

argv[1]:
* "sets-lists" / "sets-count" / "sets-dynamic": the last rank passes other process sets to
  init() (a different list; none at all; "dynamic" where the others pass none): every rank
  raises the same ValueError naming each rank's sets.
* "comm" / "comm-dynamic" (MPI, 3 ranks): ranks 0 and 1 make a set of an mpi4py communicator
  (rank 2 gets COMM_NULL); rank 1 passes it as the list [0, 1] instead; given to init() / to
  add_process_set() after init(process_sets="dynamic"): it is the set [0, 1] on every rank
  and its allreduce is right. "comm-other": rank 1 passes [1, 2]: every rank raises.
* "comm-split" (MPI, 3 ranks): each rank passes its own communicator of
  `MPI.COMM_WORLD.Split(rank % 2)` ([0, 2] or [1]), then a set of ranks: both halves are
  registered everywhere, each rank's set is its half, and allreduces in each half (at once)
  and in the global set are right.
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
    elif case == "sets-count":
        sets = [] if me == last else [hvd.ProcessSet([0, 1])]
        shown = f"ranks {list(range(last))} passed [[0, 1]]; ranks [{last}] passed []"
    else:
        sets = "dynamic" if me == last else None
        shown = f'ranks {list(range(last))} passed []; ranks [{last}] passed "dynamic"'
    try:
        hvd.init(process_sets=sets)
    except ValueError as exc:
        want = (f"ranks passed different process sets to init(): {shown}. Every rank must pass "
                "the same process_sets to hvd.init(), in the same order."
                + (' For dynamic process sets, pass process_sets="dynamic" on every rank or '
                   "set HOROVOD_DYNAMIC_PROCESS_SETS=1." if case == "sets-dynamic" else ""))
        assert str(exc) == want, str(exc)
    else:
        raise AssertionError(f"rank {me}: init() accepted process sets that differ across ranks")
    print(f"rank {me}: {case} ok", flush=True)
    sys.exit(0)

if case == "comm-split":
    from mpi4py import MPI

    half = hvd.ProcessSet(MPI.COMM_WORLD.Split(me % 2, me))
    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[half, pair])
    mine = [r for r in range(n) if r % 2 == me % 2]
    assert (half.process_set_id, half.ranks, half.rank(), half.included()) == (
        1 if me % 2 == 0 else 2, mine, mine.index(me), True), half
    assert pair.process_set_id == 3 and hvd.global_process_set.ranks == list(range(n))
    other = _current.current().registered_set(2 if me % 2 == 0 else 1)
    assert other.ranks == [r for r in range(n) if r % 2 != me % 2] and not other.included()
    h = hvd.allreduce_async(np.full(3, float(me + 1), np.float32), name="half", op=hvd.Sum,
                            process_set=half)
    g = hvd.allreduce(np.full(2, float(me), np.float32), name="all", op=hvd.Sum)
    assert np.array_equal(h.wait(30), np.full(3, float(sum(r + 1 for r in mine)), np.float32))
    assert np.array_equal(g, np.full(2, float(sum(range(n))), np.float32)), g
    if pair.included():
        out = hvd.allreduce(np.ones(1, np.float32), name="pair", op=hvd.Sum, process_set=pair)
        assert out[0] == 2.0, out
    hvd.allreduce(np.zeros(1, np.float32), name="done")
    hvd.shutdown()
    assert half.process_set_id is None and half.ranks == mine
    print(f"rank {me}: {case} ok", flush=True)
    sys.exit(0)

if case.startswith("comm"):
    from mpi4py import MPI

    sub = MPI.COMM_WORLD.Split(0 if me < 2 else MPI.UNDEFINED, me)
    given = hvd.ProcessSet({"comm-other": [1, 2]}.get(case, [0, 1]) if me == 1 else sub)
    if case == "comm-other":
        try:
            hvd.init(process_sets=[given])
        except ValueError as exc:
            want = ("ranks passed different process sets to init(): ranks [0] passed [[0, 1]]; "
                    "ranks [1] passed [[1, 2]]; ranks [2] passed [COMM_NULL]. Every rank must "
                    "pass the same process_sets to hvd.init(), in the same order. Sets of "
                    "mpi4py communicators may differ across ranks as the communicators of one "
                    "split do (MPI.COMM_WORLD.Split): every member of a communicator must pass "
                    "it, or its ranks, at the same place in the list.")
            assert str(exc) == want, str(exc)
        else:
            raise AssertionError(f"rank {me}: init() accepted process sets that differ")
        print(f"rank {me}: {case} ok", flush=True)
        sys.exit(0)
    if case == "comm":
        hvd.init(process_sets=[given])
        ps = given
    else:
        hvd.init(process_sets="dynamic")
        ps = hvd.add_process_set(given)
    assert (ps.ranks, ps.included()) == ([0, 1], me < 2), (ps, ps.included())
    if me < 2:
        out = hvd.allreduce(np.full(3, float(me + 1), np.float32), name="ps", op=hvd.Sum,
                            process_set=ps)
        assert np.array_equal(out, np.full(3, 3.0, np.float32)), out
    hvd.allreduce(np.zeros(1, np.float32), name="done")  # rank 2 stays until the set is done
    hvd.shutdown()
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
