"""SPMD script: the last rank leaves early while the others wait in an allreduce it never joins.

argv[1]: "shutdown-exit" (the last rank calls hvd.shutdown() and exits) or "plain-exit" (it
just exits; the runtime's exit hook shuts down). The others must get the shutdown error within
a few seconds, then exit cleanly.
"""
import sys
import time

import numpy as np

import collective as hvd
from collective.errors import SHUT_DOWN_MESSAGE

how = sys.argv[1]
hvd.init()
n, me = hvd.size(), hvd.rank()
assert n >= 2, "needs at least two ranks"
hvd.allreduce(np.ones(1), name="warmup")  # everyone is up
if me == n - 1:
    time.sleep(0.3)  # let the others' requests reach the coordinator
    if how == "shutdown-exit":
        hvd.shutdown()
    print(f"rank {me} leaves ({how})", flush=True)
    sys.exit(0)
handle = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="left_behind")
t0 = time.monotonic()
try:
    handle.wait(30)
except hvd.ShutdownError as exc:
    dt = time.monotonic() - t0
    # Horovod's text, then the rank that ended the job.
    assert str(exc) == (f"{SHUT_DOWN_MESSAGE} Rank(s) {n - 1} ended the job (hvd.shutdown(), "
                        "or the end of the program)."), str(exc)
    assert dt < 5.0, f"the shutdown error came only after {dt:.1f} s"
    print(f"rank {me}: shutdown error after {dt:.2f} s", flush=True)
else:
    raise AssertionError("the pending op completed although a rank left")
try:
    hvd.allreduce(np.ones(1), name="later")
except hvd.ShutdownError as exc:
    assert f"Rank(s) {n - 1} ended the job" in str(exc), str(exc)
else:
    raise AssertionError("a new op succeeded after the job shut down")
hvd.shutdown()
