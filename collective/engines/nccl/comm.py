"""NCCL communicators: the unique id exchange, `ncclCommInitRank` on a helper thread with a
deadline (`COMM_INIT_TIMEOUT`, since CuPy has no non-blocking init), draining a stream before
destroying one (`CLOSE_TIMEOUT`) and `ncclCommAbort`; the NCCL and CuPy versions in use."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import cupy
from cupy.cuda import nccl

from ... import _log
from ...errors import CollectiveTimeoutError, HorovodInternalError
from ..base import ControlPlane

__all__ = ["versions", "exchange_unique_id", "init_communicator", "COMM_INIT_TIMEOUT",
           "CLOSE_TIMEOUT"]

_log_ = _log.get_logger()

COMM_INIT_TIMEOUT = 120.0  # seconds for ncclCommInitRank; tests shorten it
CLOSE_TIMEOUT = 10.0  # seconds for the stream to drain at close() before ncclCommAbort

_rt = cupy.cuda.runtime


def _nccl_version_text(v: int) -> str:
    if v >= 20900:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def versions() -> dict[str, str]:
    """CuPy's version and the NCCL versions of CuPy (runtime and build) and of torch, if loaded."""
    out = {"cupy": cupy.__version__}
    try:
        out["nccl"] = _nccl_version_text(int(nccl.get_version()))
        out["nccl_build"] = _nccl_version_text(int(nccl.get_build_version()))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        out["nccl"] = f"unknown ({exc})"
    torch = sys.modules.get("torch")  # never imported here: only reported when loaded
    if torch is not None:
        try:
            tv = torch.cuda.nccl.version()
            out["torch_nccl"] = (".".join(str(x) for x in tv) if isinstance(tv, tuple)
                                 else _nccl_version_text(int(tv)))
        except Exception:  # noqa: BLE001 - torch without NCCL
            pass
    return out


def _uid_bytes(uid: Any) -> bytes:
    """The 128-byte wire form of a unique id: CuPy 14 gives bytes, CuPy 13 a tuple of chars."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes((int(x) + 256) % 256 for x in uid)


def _new_communicator(size: int, raw: bytes, rank: int) -> Any:
    last: BaseException | None = None
    # CuPy 14 takes the bytes form; CuPy 13 the tuple of signed chars.
    for uid in (raw, tuple(b - 256 if b > 127 else b for b in raw)):
        try:
            return nccl.NcclCommunicator(size, uid, rank)
        except (TypeError, OverflowError, ValueError) as exc:
            last = exc
    assert last is not None
    raise last


def exchange_unique_id(control: ControlPlane) -> bytes:
    """Group rank 0 makes the NCCL unique id; every rank gets its bytes (tests wrap this)."""
    return control.bcast(_uid_bytes(nccl.get_unique_id()) if control.rank == 0 else None)


def _abort_comm(comm: Any, device: int) -> None:
    """ncclCommAbort, best effort (kernels waiting on a dead peer return)."""
    try:
        with cupy.cuda.Device(device):
            comm.abort()
    except Exception as exc:  # noqa: BLE001 - best effort
        _log_.warning("ncclCommAbort failed on cuda:%d: %s", device, exc)


def _drain(stream: Any, device: int, what: str) -> bool:
    """Waits up to CLOSE_TIMEOUT for `stream` to finish its work; False (logged) if it did not
    (a kernel waits on a dead peer): the caller then aborts the communicator."""
    with cupy.cuda.Device(device):
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while not ev.done:
            if time.monotonic() > deadline:
                _log_.error("the NCCL stream of %s did not drain within %.0f s at shutdown (a "
                            "peer died?); aborting the communicator", what, CLOSE_TIMEOUT)
                return False
            time.sleep(0.001)
    return True


def init_communicator(raw: bytes, device: int, size: int, rank: int, group: list[int]) -> Any:
    """ncclCommInitRank on `device`, on a helper thread with a deadline (`COMM_INIT_TIMEOUT`):
    CuPy has no non-blocking init, and a peer that never joins would block forever.

    Raises:
        CollectiveTimeoutError: the init did not complete in time.
        HorovodInternalError: NCCL refused it.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            _rt.setDevice(device)
            box["comm"] = _new_communicator(size, raw, rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            box["error"] = exc

    t = threading.Thread(target=run, name="hvd-nccl-init", daemon=True)
    t.start()
    t.join(COMM_INIT_TIMEOUT)
    if t.is_alive():
        raise CollectiveTimeoutError(
            f"NCCL communicator init did not complete within {COMM_INIT_TIMEOUT:.0f} s on "
            f"rank {rank} of group {group} (cuda:{device}). "
            "A peer failed before joining or NCCL cannot connect the GPUs; rerun with "
            "NCCL_DEBUG=INFO to see which.")
    if "error" in box:
        exc = box["error"]
        raise HorovodInternalError(
            f"NCCL communicator init failed on rank {rank} (cuda:{device}): "
            f"{type(exc).__name__}: {exc}") from exc
    return box["comm"]
