"""`LaunchSettings`: everything a launch needs, validated once (hvdrun and horovod.run share it)."""
from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass, field
from typing import Mapping

from collective.config import environ_snapshot, read_env

from .hosts import HostInfo, get_host_assignments, total_slots

__all__ = ["LaunchSettings", "default_mode", "start_timeout_or_env", "MODE_TCP", "MODE_MPI"]

MODE_TCP, MODE_MPI = "tcp", "mpi"


def default_mode() -> str:
    """MPI when mpi4py is importable and `mpirun` is on PATH (without importing mpi4py), else tcp."""
    if importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None:
        return MODE_MPI
    return MODE_TCP


def start_timeout_or_env(given: float | None) -> float:
    """`given`, else HOROVOD_START_TIMEOUT, else 30 s (horovodrun's rule, for `hvdrun` and
    `horovod.run` alike).

    Raises:
        ValueError: HOROVOD_START_TIMEOUT is not a number (the message names it).
    """
    if given is not None:
        return float(given)
    raw = environ_snapshot().get("HOROVOD_START_TIMEOUT", "")
    return read_env({"HOROVOD_START_TIMEOUT": raw.strip()}).start_timeout


@dataclass(frozen=True)
class LaunchSettings:
    """A validated static launch plan's inputs.

    Attributes:
        env_overrides: HOROVOD_* variables from flags, and NCCL_IB_DISABLE=1 from `--tcp`
            (never the secret).
        tcp_only: Horovod's `--mpi --tcp`: MPI mode restricted to TCP transports.
    """

    num_proc: int
    hosts: tuple[HostInfo, ...]
    mode: str
    command: tuple[str, ...]
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 30.0
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    network_interfaces: tuple[str, ...] = ()
    output_filename: str | None = None
    verbose: bool = False
    prefix_timestamp: bool = False
    mpi_args: str | None = None
    binding_args: str | None = None
    tcp_only: bool = False

    def __post_init__(self) -> None:
        if self.mode not in (MODE_TCP, MODE_MPI):
            raise ValueError(f"unknown launch mode {self.mode!r}; use 'tcp' or 'mpi'")
        if not self.command:
            raise ValueError("no command to run; usage: hvdrun -np N [options] command ...")
        if self.start_timeout < 0:
            raise ValueError(f"start_timeout={self.start_timeout} must be >= 0")
        get_host_assignments(self.hosts, self.num_proc)  # raises on too few slots

    @property
    def used_hosts(self) -> tuple[HostInfo, ...]:
        """The hosts that get at least one rank, with the slots actually used."""
        used: list[HostInfo] = []
        left = self.num_proc
        for h in self.hosts:
            if left <= 0:
                break
            n = min(h.slots, left)
            used.append(HostInfo(h.hostname, n))
            left -= n
        return tuple(used)

    @property
    def total_slots(self) -> int:
        return total_slots(self.hosts)
