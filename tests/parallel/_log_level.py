"""SPMD script (tcp mode): HOROVOD_LOG_LEVEL applies to what init() logs while the world forms
(the tcp plane's "rank N of M ready" debug line), not only from the end of init() on."""
import numpy as np

import collective as hvd

hvd.init()
out = hvd.allreduce(np.ones(3), op=hvd.Sum, name="x")
assert np.allclose(out, hvd.size()), out
hvd.shutdown()
print("log level ok", flush=True)
