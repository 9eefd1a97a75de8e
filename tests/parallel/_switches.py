"""SPMD script: options without effect warn once (rank 0) at init(); HOROVOD_MPI_THREADS_DISABLE
makes ringvod start MPI at MPI_THREAD_SERIALIZED, so mpi_threads_supported() is False.

argv[1]: "disabled" (the environment sets HOROVOD_MPI_THREADS_DISABLE=1 and
HOROVOD_TORUS_ALLREDUCE=1), "cpu_gloo" (HOROVOD_CPU_OPERATIONS=gloo: the MPI job stays one
world in MPI mode, and rank 0 warns that the setting has no effect) or "default" (none is set).
"""
import sys
import warnings

import numpy as np

import collective as hvd

case = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hvd.init()
mine = [str(w.message) for w in caught if "no effect in ringvod" in str(w.message)]
cpu_ops = [str(w.message) for w in caught if "HOROVOD_CPU_OPERATIONS" in str(w.message)]
me = hvd.rank()
assert hvd.mpi_enabled(), "expected MPI mode"
assert hvd.size() == 2, hvd.size()
if case == "cpu_gloo":
    assert cpu_ops == (["HOROVOD_CPU_OPERATIONS=gloo/tcp has no effect: ringvod runs host operations "
                        "over its controller's transport (mpi mode here)"] if me == 0 else []), (
        cpu_ops)
else:
    assert cpu_ops == [], cpu_ops
if case == "disabled":
    from mpi4py import MPI
    assert MPI.Query_thread() == MPI.THREAD_SERIALIZED, MPI.Query_thread()
    assert hvd.mpi_threads_supported() is False
    want = 1 if me == 0 else 0
    assert len(mine) == want and (not mine or "HOROVOD_TORUS_ALLREDUCE" in mine[0]), mine
    assert not mine or "MPI_THREADS_DISABLE" not in mine[0], mine
else:
    assert hvd.mpi_threads_supported() is True
    assert mine == [], mine
out = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, name="x")
assert np.allclose(out, sum(range(1, hvd.size() + 1))), out
hvd.shutdown()
print(f"rank {me}: {case} ok", flush=True)
