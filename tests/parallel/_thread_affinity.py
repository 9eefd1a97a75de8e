"""SPMD script (tcp mode): HOROVOD_THREAD_AFFINITY names a core this machine does not have.
As in Horovod, pinning fails with an error line and the job runs on unpinned (it used to kill
the coordinator thread and hang every rank)."""
import numpy as np

import collective as hvd

hvd.init()
me = hvd.rank()
handles = [hvd.allreduce_async(np.full(3, me + 1.0), op=hvd.Sum, name=f"x{i}")
           for i in range(4)]  # waited for by the coordinator thread, not this one
for h in handles:
    out = hvd.synchronize(h)
    assert np.allclose(out, sum(range(1, hvd.size() + 1))), out
hvd.shutdown()
print(f"rank {me}: affinity ok", flush=True)
