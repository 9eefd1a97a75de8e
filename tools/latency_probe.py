"""Where a lone synchronous allreduce spends its time: a per-stage breakdown.

Wraps the stages of one op with timestamps (no code changes in the library) and runs a lone
synchronous allreduce many times, then prints the median time from the call to each stage:

    call -> express lane entered (synchronous API) / enqueued (async API) -> cycle or express
    round start -> negotiated (allreduce_words returned) -> perform -> engine launch start/end
    -> handle set -> returned -> device synchronized

Launch one process per device (CPU works too, for the host path)::

    mpirun -np 2 python tools/latency_probe.py [--device cuda] [--bytes 4096]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common  # noqa: F401 - NVLS off, the repository root on sys.path
import torch

import collective.coordinator as coord_mod
import collective.handle as handle_mod
import frameworks.torch as hvd

_now = time.perf_counter
_marks: list[tuple[str, float]] = []


def _mark(label: str) -> None:
    _marks.append((label, _now()))


def _wrap(obj, attr, before=None, after=None):
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        if before:
            _mark(before)
        r = fn(*a, **k)
        if after:
            _mark(after)
        return r
    setattr(obj, attr, wrapped)


def instrument(rt) -> None:
    c = rt.coordinator
    _wrap(c, "run_cycle", before="cycle")
    _wrap(c, "express", before="express>")
    _wrap(c, "_express_round", before="round>")
    _wrap(c, "_device_hold", after="hold?")
    ps = rt.member_sets()[0]
    _wrap(ps.control, "allreduce_words", before="words>", after="words<")
    _wrap(c, "_perform", before="perform>", after="perform<")
    eng = ps.device_engine or ps.host_engine
    _wrap(eng, "_allreduce", before="launch>", after="launch<")
    orig = handle_mod.Handle._finish

    def fin(self, result, exc):
        _mark("set")
        return orig(self, result, exc)
    handle_mod.Handle._finish = fin


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--sync-api", action="store_true", help="hvd.allreduce_ instead of "
                   "allreduce_async_ + synchronize")
    p.add_argument("--no-drive", action="store_true", help="A/B: the coordinator thread runs "
                   "every cycle (Coordinator.drive and express disabled)")
    p.add_argument("--no-express", action="store_true", help="A/B: no express lane (the "
                   "synchronous op is queued and its cycle driven by the caller)")
    a = p.parse_args()
    hvd.init()
    if a.no_drive:
        coord_mod.Coordinator.drive = lambda self: self._wake.set()
        coord_mod.Coordinator.express = lambda self, ps, entry: False
    if a.no_express:
        coord_mod.Coordinator.express = lambda self, ps, entry: False
    dev = a.device
    if dev == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    x = torch.ones(a.bytes // 4, device=dev)
    for _ in range(20):
        hvd.allreduce_(x, op=hvd.Sum, name="probe")
    sync()
    from collective import _current as runtime
    instrument(runtime.current())
    rows = []
    for _ in range(a.iters):
        _marks.clear()
        t0 = _now()
        if a.sync_api:
            hvd.allreduce_(x, op=hvd.Sum, name="probe")
        else:
            h = hvd.allreduce_async_(x, op=hvd.Sum, name="probe")
            _mark("enqueued")
            hvd.synchronize(h)
        _mark("returned")
        sync()
        _mark("synced")
        rows.append((t0, list(_marks)))
    stages = ["express>", "round>", "enqueued", "hold?", "cycle", "words>", "words<", "perform>",
              "launch>", "launch<", "set", "perform<", "returned", "synced"]
    med = {}
    counts = {}
    for s in stages:
        vals = []
        for t0, marks in rows:
            ts = [t for lab, t in marks if lab == s]
            if ts:
                vals.append((ts[0] - t0) * 1e6)
        counts[s] = sum(sum(1 for lab, _ in m if lab == s) for _, m in rows) / len(rows)
        med[s] = statistics.median(vals) if vals else float("nan")
    # also cycles per op
    if hvd.rank() == 0:
        api = "allreduce_" if a.sync_api else "allreduce_async_ + synchronize"
        api += " (no drive)" if a.no_drive else " (no express lane)" if a.no_express else ""
        print(f"lone {a.bytes} B {api} on {dev}, {hvd.size()} ranks, {a.iters} ops; median "
              "us from the call to the first occurrence of each stage (count per op):")
        for s in stages:
            print(f"  {s:10s} {med[s]:8.1f}   x{counts[s]:.2f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
