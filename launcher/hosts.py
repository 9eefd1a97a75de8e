"""Host lists and slot assignment for `hvdrun` (pure functions, no I/O except reading a hostfile).

`-H h1:2,h2:4` and hostfiles (`h1 slots=2`) become `HostInfo`s; `get_host_assignments` walks the
hosts in the given order and fills each host's slots with consecutive ranks, exactly as Horovod's
`get_host_assignments` does:

* local_rank is the slot index on its host, local_size the number of ranks placed on that host;
* cross_rank is the position of the host among the hosts that have a rank with that local_rank,
  cross_size the number of those hosts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["HostInfo", "SlotInfo", "parse_hosts", "parse_hostfile", "parse_hostfile_text",
           "get_host_assignments", "total_slots", "hosts_arg"]

_HOST_ENTRY = re.compile(r"^\w[\w.-]*:[0-9]+$")  # no leading "-": never an ssh option
_HOSTFILE_LINE = re.compile(r"^(?P<host>\w[\w.-]*)(?:\s+slots\s*=\s*(?P<slots>[0-9]+))?\s*$")


@dataclass(frozen=True)
class HostInfo:
    """A host and the number of processes it may run."""

    hostname: str
    slots: int

    def __str__(self) -> str:
        return f"{self.hostname}:{self.slots}"


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the global, local and cross scopes."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def _check_unique(hosts: Sequence[HostInfo], source: str) -> None:
    seen: set[str] = set()
    for h in hosts:
        if h.hostname in seen:
            raise ValueError(
                f"host {h.hostname!r} appears more than once in {source}; give it once with the "
                f"total number of slots (e.g. {h.hostname}:4)")
        seen.add(h.hostname)


def parse_hosts(hosts_string: str, source: str = "-H") -> list[HostInfo]:
    """Parses `-H/--hosts` text such as `worker-0:2,worker-1:2`.

    `source` names the argument in messages (`horovod.run` passes "hosts").

    Raises:
        ValueError: an entry does not match `^\\w[\\w.-]*:[0-9]+$` (a host name begins with
            a letter, digit or underscore), a host repeats, or has 0 slots.
    """
    hosts: list[HostInfo] = []
    for entry in hosts_string.split(","):
        entry = entry.strip()
        if not _HOST_ENTRY.match(entry):
            raise ValueError(
                f"Invalid host input {entry!r} in {hosts_string!r}, please make sure it has "
                f"format as : worker-0:2,worker-1:2.")
        name, slots = entry.rsplit(":", 1)
        if int(slots) <= 0:
            raise ValueError(f"host {name!r} in {source} has {slots} slots; give at least 1 "
                             f"(e.g. {name}:1)")
        hosts.append(HostInfo(name, int(slots)))
    _check_unique(hosts, source)
    return hosts


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[HostInfo]:
    """Parses hostfile content: one `hostname [slots=N]` per line; `#` starts a comment.

    A line without `slots=` counts one slot (as Open MPI's hostfiles do).

    Raises:
        ValueError: a line is malformed, a host repeats, or the file lists no host.
    """
    hosts: list[HostInfo] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOSTFILE_LINE.match(line)
        if not m:
            raise ValueError(f"{source}:{lineno}: cannot parse {raw.strip()!r}; expected "
                             f"'hostname slots=N'")
        slots = int(m.group("slots")) if m.group("slots") is not None else 1
        if slots <= 0:
            raise ValueError(f"{source}:{lineno}: host {m.group('host')!r} has {slots} slots; "
                             f"give at least 1")
        hosts.append(HostInfo(m.group("host"), slots))
    if not hosts:
        raise ValueError(f"{source} lists no hosts; expected lines like 'hostname slots=N'")
    _check_unique(hosts, source)
    return hosts


def parse_hostfile(path: str) -> list[HostInfo]:
    """Reads and parses a hostfile (see `parse_hostfile_text`).

    Raises:
        OSError: the file cannot be read.
        ValueError: the content is malformed.
    """
    with open(path, encoding="utf-8") as f:
        return parse_hostfile_text(f.read(), source=path)


def total_slots(hosts: Iterable[HostInfo]) -> int:
    return sum(h.slots for h in hosts)


def hosts_arg(hosts: Iterable[HostInfo]) -> str:
    """The `-H` form of a host list: `h1:2,h2:4`."""
    return ",".join(str(h) for h in hosts)


def get_host_assignments(hosts: Sequence[HostInfo], num_proc: int) -> list[SlotInfo]:
    """Assigns `num_proc` ranks to host slots in host order.

    Returns:
        One `SlotInfo` per rank, ordered by rank.

    Raises:
        ValueError: num_proc < 1, or more processes than slots were requested.
    """
    if num_proc < 1:
        raise ValueError(f"-np must be at least 1 (got {num_proc})")
    available = total_slots(hosts)
    if num_proc > available:
        raise ValueError(
            f"Requested more processes ({num_proc}) than there are available slots "
            f"({available}); hosts: {hosts_arg(hosts) or '(none)'}. Lower -np or add slots.")
    placed: list[tuple[str, int, int]] = []  # (host, rank, local_rank)
    local_sizes: dict[str, int] = {}
    rank = 0
    for h in hosts:
        n = min(h.slots, num_proc - rank)
        if n <= 0:
            break
        for local_rank in range(n):
            placed.append((h.hostname, rank, local_rank))
            rank += 1
        local_sizes[h.hostname] = n
    # Hosts that own a given local_rank, in host order: cross_rank indexes into this list.
    cross_hosts: dict[int, list[str]] = {}
    for host, _, local_rank in placed:
        cross_hosts.setdefault(local_rank, []).append(host)
    return [SlotInfo(hostname=host, rank=r, local_rank=lr,
                     cross_rank=cross_hosts[lr].index(host), size=num_proc,
                     local_size=local_sizes[host], cross_size=len(cross_hosts[lr]))
            for host, r, lr in placed]
