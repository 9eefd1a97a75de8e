"""Worker environments: what `hvdrun` passes to each rank (the only writer of a child's env).

Local workers inherit the launcher's environment (so `CUDA_VISIBLE_DEVICES` set for the job
still applies to them); remote workers get the exportable part of it, i.e. without session- and
host-specific variables, shell functions, device masks of this machine and secrets (Horovod's
`IGNORE_REGEXES`). On top come the rank variables, the rendezvous address and the job secret.

The secret never appears on a command line: local workers get it in their environment, ssh
workers read it from the ssh channel's stdin (see `launcher/remote_exec.py`).
"""
from __future__ import annotations

import os
import re
from typing import Mapping

from .hosts import SlotInfo

__all__ = ["SECRET_ENV", "EXCLUDED_PATTERNS", "is_exportable", "exportable_env", "worker_env",
           "redact"]

SECRET_ENV = "HOROVOD_SECRET_KEY"

# Never exported to another host: shell functions, per-session/per-host variables, this
# machine's device masks and any job secret.
EXCLUDED_PATTERNS: tuple[str, ...] = (
    r"BASH_FUNC_.*", r"OLDPWD", r"PWD", r"SHLVL", r"_", r"HOSTNAME", r"SSH_(CLIENT|CONNECTION|TTY|AUTH_SOCK)",
    r".*CUDA_VISIBLE_DEVICES", r"_?HOROVOD_SECRET_KEY",
)
_EXCLUDED = re.compile("^(?:" + "|".join(EXCLUDED_PATTERNS) + ")$")

# Rank variables of MPI launchers: if hvdrun itself runs under mpirun/srun, they must not leak
# into tcp-mode workers, or `init()` would detect the wrong launcher.
_FOREIGN_RANK_VARS = re.compile(r"^(OMPI_COMM_WORLD_.*|PMI_RANK|PMI_SIZE|PMIX_RANK)$")

_VALID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_exportable(name: str) -> bool:
    """Whether a variable may be sent to another host (by ssh or `mpirun -x`)."""
    return bool(_VALID_NAME.match(name)) and not _EXCLUDED.match(name)


def exportable_env(parent: Mapping[str, str]) -> dict[str, str]:
    """The part of `parent` that is sent to remote workers."""
    return {k: v for k, v in parent.items() if is_exportable(k)}


def worker_env(parent: Mapping[str, str], slot: SlotInfo, *, remote: bool,
               overrides: Mapping[str, str], rendezvous: tuple[str, int] | None,
               secret_hex: str | None, oversubscribed: bool) -> dict[str, str]:
    """The complete environment of one tcp-mode worker.

    Args:
        parent: the launcher's environment.
        slot: where the rank runs.
        remote: True for ssh workers (only exportable variables are kept).
        overrides: HOROVOD_* variables from hvdrun flags (they win over `parent`).
        rendezvous: (address, port) of the job's KV server, or None.
        secret_hex: the job secret as hex, or None.
        oversubscribed: more ranks than cores on this host; sets Open MPI's yield-when-idle.

    Raises:
        ValueError: an override name is not a valid variable name.
    """
    env = exportable_env(parent) if remote else dict(parent)
    for name in list(env):
        if _FOREIGN_RANK_VARS.match(name):
            del env[name]
    for k, v in overrides.items():
        if not _VALID_NAME.match(k):
            raise ValueError(f"invalid environment variable name {k!r}")
        env[k] = v
    env.update({
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "PYTHONUNBUFFERED": "1",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    })
    if rendezvous is not None:
        env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = rendezvous[0]
        env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(rendezvous[1])
    env.pop("_HOROVOD_SECRET_KEY", None)
    if secret_hex is not None:
        env[SECRET_ENV] = secret_hex
    else:
        env.pop(SECRET_ENV, None)
    if oversubscribed:
        # With more ranks than cores, Open MPI's busy polling makes latency bimodal.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return env


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """A copy safe to print: secrets replaced by `<redacted>`."""
    return {k: ("<redacted>" if "SECRET" in k.upper() else v) for k, v in env.items()}


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
