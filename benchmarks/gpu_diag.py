"""Where the time goes on the GPU path: thread hand-offs, per-op latency, and a ResNet-50
training step under runtime variants, with counters (cycles, responses, hook and engine time).

Launch with one process per GPU (mpirun ... python benchmarks/gpu_diag.py). Variants change
only process-local knobs between runs of the same processes: the coordinator's spin count
(`collective.coordinator._SPIN_CYCLES`), the interpreter's GIL switch interval, and the cycle
time (re-init with HOROVOD_CYCLE_TIME). Rank 0 prints one line per measurement.
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

import collective  # noqa: E402
import collective.coordinator as coord  # noqa: E402
import frameworks.torch as hvd  # noqa: E402
from collective.engines import nccl as nccl_engine  # noqa: E402
from frameworks.torch import optimizer as hopt  # noqa: E402

STATS = {"cycles": 0, "cycle_s": 0.0, "responses": 0, "tensors": 0, "engine_s": 0.0,
         "hook_s": 0.0, "hooks": 0}


def _wrap() -> None:
    run_cycle = coord.Coordinator.run_cycle
    perform = coord.Coordinator._perform
    ar = nccl_engine.NCCLEngine.allreduce
    on_grad = hopt._DistributedMixin._hvd_on_grad if hasattr(hopt, "_DistributedMixin") else None

    def run_cycle_w(self):
        t = time.perf_counter()
        try:
            return run_cycle(self)
        finally:
            STATS["cycles"] += 1
            STATS["cycle_s"] += time.perf_counter() - t

    def perform_w(self, ps, resp):
        STATS["responses"] += 1
        STATS["tensors"] += len(resp.names)
        return perform(self, ps, resp)

    def ar_w(self, entries, resp):
        t = time.perf_counter()
        try:
            return ar(self, entries, resp)
        finally:
            STATS["engine_s"] += time.perf_counter() - t

    coord.Coordinator.run_cycle = run_cycle_w
    coord.Coordinator._perform = perform_w
    nccl_engine.NCCLEngine.allreduce = ar_w
    cls = None
    for name in dir(hopt):
        obj = getattr(hopt, name)
        if isinstance(obj, type) and hasattr(obj, "_hvd_on_grad"):
            cls = obj
            break
    if cls is not None:
        orig = cls._hvd_on_grad

        def on_grad_w(self, slot):
            t = time.perf_counter()
            try:
                return orig(self, slot)
            finally:
                STATS["hooks"] += 1
                STATS["hook_s"] += time.perf_counter() - t
        cls._hvd_on_grad = on_grad_w


def say(msg: str) -> None:
    if hvd.rank() == 0:
        print(msg, flush=True)


def handoff_latency() -> None:
    a, b = threading.Event(), threading.Event()
    n = 2000

    def peer():
        for _ in range(n):
            a.wait()
            a.clear()
            b.set()
    t = threading.Thread(target=peer, daemon=True)
    t.start()
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        a.set()
        b.wait()
        b.clear()
        ts.append(time.perf_counter() - s)
    t.join()
    s = time.perf_counter()
    for _ in range(1000):
        time.sleep(0)
    sl0 = (time.perf_counter() - s) / 1000
    e = threading.Event()
    s = time.perf_counter()
    for _ in range(200):
        e.wait(1e-4)
    w = (time.perf_counter() - s) / 200
    say(f"DIAG thread round trip median {statistics.median(ts) * 1e6:.1f} us; sleep(0) "
        f"{sl0 * 1e6:.1f} us; Event.wait(100us) {w * 1e6:.1f} us; "
        f"switchinterval {sys.getswitchinterval()}")


def op_latency(label: str) -> None:
    x = np.ones(1024, np.float32)
    g = torch.ones(1024, device="cuda")
    res = {}
    for kind in ("host", "gpu"):
        ts = []
        for i in range(320):
            s = time.perf_counter()
            if kind == "host":
                collective.allreduce(x, name="lat.h", op=collective.Sum)
            else:
                hvd.allreduce_(g, name="lat.g", op=hvd.Sum)
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - s)
        res[kind] = statistics.median(ts[20:]) * 1e6
    say(f"DIAG {label}: lone 4KiB allreduce host {res['host']:.0f} us, gpu {res['gpu']:.0f} us")


def resnet(label: str, amp: bool, steps: int = 30) -> float:
    model, opt, x, y = MODEL
    for k in STATS:
        STATS[k] = 0 if isinstance(STATS[k], int) else 0.0

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    for k in STATS:
        STATS[k] = 0 if isinstance(STATS[k], int) else 0.0
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    ips = torch.tensor([64 / dt])
    ips = hvd.allreduce(ips, op=hvd.Sum, name="diag.ips")
    s = STATS
    say(f"DIAG resnet {label} amp={amp}: {ips.item():.0f} img/s total, step {dt * 1e3:.1f} ms; "
        f"per step: cycles {s['cycles'] / steps:.0f} ({s['cycle_s'] / steps * 1e3:.1f} ms), "
        f"responses {s['responses'] / steps:.1f}, tensors {s['tensors'] / steps:.0f}, "
        f"engine {s['engine_s'] / steps * 1e3:.2f} ms, hooks {s['hooks'] / steps:.0f} "
        f"({s['hook_s'] / steps * 1e3:.2f} ms)")
    return ips.item()


MODEL: tuple = ()


def main() -> int:
    global MODEL
    only = [v for v in (sys.argv[1].split(",") if len(sys.argv) > 1 else []) if v]
    nccl_engine.GIL_SWITCH_INTERVAL = None  # the variants set it themselves
    _wrap()
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    torch.backends.cudnn.benchmark = True
    handoff_latency()
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device="cuda")
    MODEL = (model, opt, x, y)
    variants = [("default", 200, 0.005), ("switch100us", 200, 1e-4), ("nospin", 0, 0.005),
                ("nospin+switch100us", 0, 1e-4), ("nospin+switch500us", 0, 5e-4)]
    say(f"DIAG mode {collective.mode()}")
    for label, spin, sw in variants:
        if only and label not in only:
            continue
        coord._SPIN_CYCLES = spin
        sys.setswitchinterval(sw)
        op_latency(label)
        resnet(label, amp=False)
        resnet(label, amp=True)
    for cyc in (("0.2", "5") if not only else ()):
        coord._SPIN_CYCLES = 0
        sys.setswitchinterval(1e-4)
        hvd.shutdown()
        os.environ["HOROVOD_CYCLE_TIME"] = cyc
        hvd.init()
        op_latency(f"nospin+switch100us cycle={cyc}ms")
        resnet(f"nospin+switch100us cycle={cyc}ms", amp=False)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
