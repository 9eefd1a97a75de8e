"""Step-by-step check of the CUDA stream memory operations behind device-side waits, with a
print before every driver call and a faulthandler dump if anything blocks for 20 s."""
import faulthandler
import sys
import time

faulthandler.enable()
faulthandler.dump_traceback_later(20, exit=True)
import ctypes  # noqa: E402

import cupy  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, ".")
from collective.engines._stream_flags import DriverOps  # noqa: E402


def say(*a):
    print("STEP", *a, flush=True)


torch.cuda.set_device(0)
torch.ones(1, device="cuda")
rt = cupy.cuda.runtime
lib = ctypes.CDLL("libcuda.so.1")
say("symbols", {n: hasattr(lib, n) for n in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32",
                                              "cuStreamWriteValue32_v2", "cuStreamWriteValue32")})
dev = ctypes.c_int()
for attr in (92, 93, 94, 95, 124):
    v = ctypes.c_int(-1)
    rc = lib.cuDeviceGetAttribute(ctypes.byref(v), attr, 0)
    say("attr", attr, "rc", rc, "value", v.value)
ops = DriverOps(rt)
say("alloc")
base = ops.alloc(4096)
words = (ctypes.c_uint32 * 16).from_address(base)
say("alloc ok", hex(base))
keep = cupy.cuda.Stream(non_blocking=True)  # alive for the whole check
others = []
for label, stream in (("private", int(keep.ptr)), ("legacy", 0)):
    for i, how in enumerate(("host", "stream")):
        slot = (0 if label == "private" else 8) + i
        addr = base + 4 * slot
        say(label, how, "wait")
        rc = ops.wait(stream, addr, 1)
        say(label, how, "wait rc", rc)
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        say(label, how, "record")
        rt.eventRecord(ev.ptr, stream)
        time.sleep(0.01)
        say(label, how, "held", not ev.done)
        if how == "host":
            words[slot] = 1
        else:
            other = cupy.cuda.Stream(non_blocking=True)
            others.append(other)
            say(label, how, "write rc", ops.write(int(other.ptr), addr, 1))
        t = time.monotonic()
        while not ev.done and time.monotonic() - t < 3:
            time.sleep(0.001)
        say(label, how, "released", ev.done, f"{(time.monotonic() - t) * 1e3:.1f} ms",
            "word", words[slot])
        if not ev.done:
            words[slot] = 1
say("synchronize")
torch.cuda.synchronize()
say("done")
