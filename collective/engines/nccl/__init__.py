"""The NCCL engine: collectives on GPU tensors through CuPy's NCCL binding (`cupy.cuda.nccl`).

One engine per process set (the coordinator creates it on the set's first device response), one
communicator per engine, bound to the GPU of that first op's tensors, whichever device is
current: every CUDA call that names a device's default stream or records an event runs with
that device current (`_on_device`), and the engine makes its own device current before its
work. A later op of the set whose tensor is on another device fails, naming both devices.
docs/gpu.md ("How it works") describes it; in short:

* Binding: every rank reports over the control plane whether it can use its GPU before group
  rank 0's unique id is broadcast; the init runs on a helper thread with a deadline
  (`COMM_INIT_TIMEOUT`), since CuPy has no non-blocking init.
* Ordering: the engine's own high-priority stream waits on each entry's ready event, runs pack,
  scaling, the NCCL call and unpack, and records one completion event per op; the handle
  completes on the host at once and its `DeviceResult` orders the caller's stream. A
  synchronous op in the express lane (an `OnStream` marker instead of a ready event) runs on
  its caller's stream instead, with one event recorded after it and no waits; an op launched
  on another stream than the communicator's latest waits for that one first, so its kernels
  never overlap. Nothing
  blocks the host except a staging slot still in use (`CopyStager`) and `close()`.
* Memory: outputs and the fusion buffer come from the entry's allocator with the engine stream
  as allocation stream (the caller's stream for an op run there); an op's entries stay
  referenced until its completion event fired.
* Fusion: one batched-copy launch packs a fused response, one NCCL call reduces it, one more
  launch unpacks it (`kernels.py`); a fused allreduce's members of `DIRECT_BYTES` (1 MiB) or
  more skip the buffer, each reduced where it lies by an NCCL call of its own in one NCCL
  group with the buffer's call, unless members share memory.
* Failures: a dtype NCCL cannot reduce fails that op on every rank; a CUDA/NCCL error fails the
  op's handles with `HorovodInternalError`, aborts the communicator and ends the coordinator
  loop; `abort()` (ncclCommAbort) frees kernels stuck on a dead peer; `close()` destroys the
  communicator once the stream drained, else aborts it after `CLOSE_TIMEOUT`.

| module | its job |
|---|---|
| `comm.py` | communicator setup with a deadline, drain and abort; NCCL and CuPy versions |
| `events.py` | completion events and the ready-event pool adapters record into |
| `engine.py` | `NCCLEngine`: binding, per-op plumbing, allreduce and broadcast |
| `layouts.py` | allgather, alltoall and reducescatter bodies |
| `kernels.py` | batched-copy and scaling kernels (NVRTC through CuPy) |

Importing the package needs CuPy with NCCL; the engine registry
(collective/engines/__init__.py) turns a missing CuPy into `EngineUnavailableError`.
"""
from __future__ import annotations

from ...errors import EngineUnavailableError

try:
    import cupy  # noqa: F401
    from cupy.cuda import nccl  # noqa: F401
except ImportError as exc:  # pragma: no cover - the registry reports it
    raise EngineUnavailableError(
        "GPU tensors need CuPy with NCCL. For CUDA 12 (torch.version.cuda 12.x): "
        "`pip install cupy-cuda12x nvidia-nccl-cu12`; for CUDA 13: "
        "`pip install cupy-cuda13x nvidia-nccl-cu13` "
        "(from a ringvod clone: `pip install \".[gpu]\"` / `\".[gpu-cu13]\"`)") from exc

from .comm import init_communicator, versions  # noqa: E402
from .engine import (NCCLEngine, UnsupportedOnGPUError, create_engine, guest_enter,  # noqa: E402
                     guest_exit)

__all__ = ["NCCLEngine", "UnsupportedOnGPUError", "create_engine", "versions", "guest_enter",
           "guest_exit", "init_communicator"]
