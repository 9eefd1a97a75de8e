"""CPU binding for the GPU benchmarks (an experiment switch, off by default).

`RINGVOD_BENCH_BIND=numa` binds the process to the CPUs of its GPU's NUMA node (sysfs
`local_cpulist` of the GPU's PCI device); `split` also divides those CPUs, by physical core,
among the GPUs that share the node, so that two ranks never share a core. The GPU is the
process's local rank (`OMPI_COMM_WORLD_LOCAL_RANK`, `LOCAL_RANK`, `HOROVOD_LOCAL_RANK`) unless
`RINGVOD_BENCH_GPU` names one (for single-GPU runs under `CUDA_VISIBLE_DEVICES`). Call
`bind()` before torch starts threads: threads inherit the affinity of the thread that creates
them. Prints one `BIND ...` line.
"""
from __future__ import annotations

import os
import subprocess


def _parse_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _gpu_bus_ids() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    # nvidia-smi: 00000000:19:00.0; sysfs: 0000:19:00.0
    return [b.strip().lower()[-12:] for b in out.splitlines() if b.strip()]


def _local_cpus(bus: str) -> list[int]:
    with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
        return _parse_list(f.read())


def _core_of() -> dict[int, tuple[int, int]]:
    """cpu -> (socket, core) from sysfs topology."""
    core: dict[int, tuple[int, int]] = {}
    for cpu in os.sched_getaffinity(0):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "core_id") as f:
                c = int(f.read())
            with open(base + "physical_package_id") as f:
                s = int(f.read())
        except OSError:
            c, s = cpu, 0
        core[cpu] = (s, c)
    return core


def bind() -> None:
    mode = os.environ.get("RINGVOD_BENCH_BIND", "")
    if not mode or mode == "none":
        return
    try:
        _bind(mode)
    except Exception as exc:  # noqa: BLE001 - an experiment switch: run unbound, say so
        print(f"BIND {mode} failed, running unbound: {exc!r}", flush=True)


def _bind(mode: str) -> None:
    gpu = os.environ.get("RINGVOD_BENCH_GPU")
    if gpu is None:
        gpu = next((os.environ[k] for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK",
                                            "HOROVOD_LOCAL_RANK") if k in os.environ), "0")
    gpu_i = int(gpu)
    buses = _gpu_bus_ids()
    allowed = os.sched_getaffinity(0)
    mine = [c for c in _local_cpus(buses[gpu_i]) if c in allowed] or sorted(allowed)
    if mode == "split":
        peers = [i for i, b in enumerate(buses)
                 if set(_local_cpus(b)) & set(mine)] or [gpu_i]
        core = _core_of()
        cores = sorted({core[c] for c in mine if c in core})
        share = len(cores) // len(peers) or 1
        k = peers.index(gpu_i) if gpu_i in peers else 0
        picked = set(cores[k * share:(k + 1) * share])
        mine = [c for c in mine if core.get(c) in picked] or mine
    os.sched_setaffinity(0, mine)
    print(f"BIND gpu {gpu_i} mode {mode}: {len(mine)} cpus {_compact(mine)}", flush=True)


def _compact(cpus: list[int]) -> str:
    cpus = sorted(cpus)
    out, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(out)
