"""Checks device-side waits (`collective/engines/_stream_flags.py`) on one GPU, without NCCL:
the first wait self-tests the driver calls on the caller's stream, then a handle completed
from another thread (as the coordinator does) must release torch's current stream (the legacy
default stream, handle 0, in most scripts), and a failed handle must too. Every wait is
bounded: prints PROBE lines and exits non-zero on a failure instead of hanging.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import torch  # noqa: E402

from collective.engines import device, nccl  # noqa: E402
from collective.handle import Handle  # noqa: E402


def released(ev: torch.cuda.Event, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def main() -> int:
    faulthandler.enable()
    faulthandler.dump_traceback_later(25, exit=True)  # a hang shows where, then exits
    print("PROBE start", flush=True)
    torch.cuda.set_device(0)
    cur = torch.cuda.current_stream()
    x = torch.ones(1 << 20, device="cuda")
    ok = True
    for label, fail in (("launched", False), ("failed", True)):
        h = Handle(f"probe.{label}")
        raw = int(cur.cuda_stream)
        t0 = time.perf_counter()
        took = device.wait_on_device(h, raw)
        t1 = time.perf_counter()
        x.add_(1)  # work behind the wait
        ev = torch.cuda.Event()
        ev.record(cur)
        time.sleep(0.005)
        held = not ev.query()
        eng_stream = cupy.cuda.Stream(non_blocking=True)
        cev = cupy.cuda.Event(block=False, disable_timing=True)
        cev.record(eng_stream)

        def complete() -> None:
            if fail:
                h._set_exception(RuntimeError("probe failure"))
            else:
                h._set_result(device.DeviceResult(None, nccl._Completion(cev, int(eng_stream.ptr))))
        t = threading.Thread(target=complete)
        t.start()
        t.join()
        rel = released(ev)
        print(f"PROBE {label}: stream {raw} wait taken={took} ({(t1 - t0) * 1e6:.0f} us, first "
              f"call self-tests) held={held} released={rel}; state {nccl.stream_flags_state()}",
              flush=True)
        ok = ok and took and held and rel
    torch.cuda.synchronize()
    print(f"PROBE {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
