"""Host discovery, host order and the blacklist of the elastic driver (stdlib only).

* `HostDiscoveryScript`: Horovod's `--host-discovery-script`. Each stdout line is `hostname` or
  `hostname:slots` (`--slots-per-host` for a bare name); blank lines and duplicates are
  ignored. The driver polls it every second.
* `FixedHosts`: a fixed `-H`/`--hostfile` list.
* `as_discovery(obj)`: anything with `find_available_hosts_and_slots()`, or any callable that
  returns `{hostname: slots}` (so other front ends, e.g. a Ray cluster, plug their own in).
* `HostManager`: keeps the host order stable (hosts keep their place, new hosts go to the end,
  so older hosts get lower ranks) and the blacklist of hosts whose workers failed, with an
  optional cooldown (`--blacklist-cooldown-range lo hi`: `lo * 2**n + U(0, lo)` seconds after
  the n-th failure, clamped to [lo, hi]; without it a failed host stays out for good).
"""
from __future__ import annotations

import os
import random
import re
import secrets
import subprocess
import threading
import time
from typing import Any, Callable, Mapping

from .._proc import kill_process_tree
from ..hosts import HostInfo

__all__ = ["HostDiscovery", "HostDiscoveryScript", "FixedHosts", "CallableDiscovery",
           "as_discovery", "HostManager", "DiscoveryError", "parse_discovery_output"]

# Set, to a value of its own, in the environment of each run of a discovery script: what
# `kill_process_tree` looks for when the run has to be killed.
RUN_MARKER_ENV = "RINGVOD_DISCOVERY_RUN"

_LINE = re.compile(r"^(?P<host>\w[\w.-]*)(?::(?P<slots>[0-9]+))?$")


class DiscoveryError(RuntimeError):
    """The host discovery script failed or printed something that is not a host list."""


class HostDiscovery:
    """Where the elastic driver learns which hosts exist and how many slots each has."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        raise NotImplementedError


def parse_discovery_output(text: str, default_slots: int | None, source: str) -> dict[str, int]:
    """`{hostname: slots}` from discovery lines (`host` or `host:slots`).

    Raises:
        DiscoveryError: a line does not parse, or a bare name has no `--slots-per-host`.
    """
    hosts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise DiscoveryError(f"{source} printed {line!r}; expected 'hostname' or "
                                 "'hostname:slots' per line")
        if m.group("slots") is not None:
            slots = int(m.group("slots"))
        elif default_slots is not None:
            slots = default_slots
        else:
            raise DiscoveryError(f"{source} printed {line!r} without a slot count; print "
                                 "'hostname:slots' or pass --slots-per-host")
        hosts[m.group("host")] = slots
    return hosts


class HostDiscoveryScript(HostDiscovery):
    """Runs `script` (through the shell) and parses its output.

    Raises (from `find_available_hosts_and_slots`):
        DiscoveryError: the script exited non-zero, timed out or printed garbage.
    """

    def __init__(self, script: str, default_slots: int | None = None,
                 timeout: float = 30.0) -> None:
        self.script, self.default_slots, self.timeout = script, default_slots, timeout
        self._lock = threading.Lock()
        self._running: tuple[subprocess.Popen, str] | None = None
        self._closed = False

    def close(self) -> None:
        """Kills the run in progress, if any (with everything it started), and refuses new
        runs: the job is over, and a hung run must not outlive hvdrun."""
        with self._lock:
            self._closed = True
            running, self._running = self._running, None
        if running is not None:
            kill_process_tree(running[0].pid, running[1])

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        # The script runs in a session of its own, with a variable of this run in its
        # environment, so that a timeout (or an interrupt) kills the shell and everything it
        # started: its process group, and (Linux) any child that left the group or the session
        # (`setsid`) or was orphaned, found by its ancestry or by the inherited variable.
        token = secrets.token_hex(8)
        marker = f"{RUN_MARKER_ENV}={token}"
        with self._lock:
            if self._closed:
                raise DiscoveryError(f"host discovery script {self.script!r}: the job is over")
            try:
                proc = subprocess.Popen(self.script, shell=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        start_new_session=True,
                                        env={**os.environ, RUN_MARKER_ENV: token})
            except OSError as exc:
                raise DiscoveryError(f"cannot run host discovery script {self.script!r}: "
                                     f"{exc}") from None
            self._running = (proc, marker)
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_all(proc, marker)
            raise DiscoveryError(f"host discovery script {self.script!r} did not finish "
                                 f"within {self.timeout:.0f} s") from None
        except BaseException:
            _kill_all(proc, marker)
            raise
        finally:
            with self._lock:
                if self._running is not None and self._running[0] is proc:
                    self._running = None
        if proc.returncode != 0:
            err = stderr.strip().splitlines()
            raise DiscoveryError(f"host discovery script {self.script!r} exited with status "
                                 f"{proc.returncode}{': ' + err[-1] if err else ''}")
        return parse_discovery_output(stdout, self.default_slots,
                                      f"host discovery script {self.script!r}")


def _kill_all(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILLs `proc` and what it started (`kill_process_tree`), reaps `proc` and closes its
    pipes."""
    kill_process_tree(proc.pid, marker)
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class FixedHosts(HostDiscovery):
    def __init__(self, hosts: Mapping[str, int] | list[HostInfo]) -> None:
        if isinstance(hosts, list):
            hosts = {h.hostname: h.slots for h in hosts}
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.hosts)


class CallableDiscovery(HostDiscovery):
    def __init__(self, fn: Callable[[], Mapping[str, int]]) -> None:
        self.fn = fn

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return {str(h): int(s) for h, s in self.fn().items()}


def as_discovery(obj: Any) -> HostDiscovery:
    """A `HostDiscovery` from a discovery object or a `() -> {host: slots}` callable."""
    if hasattr(obj, "find_available_hosts_and_slots"):
        return obj
    if callable(obj):
        return CallableDiscovery(obj)
    raise TypeError(f"host discovery must have find_available_hosts_and_slots() or be a "
                    f"callable returning {{host: slots}}; got {type(obj).__name__}")


class HostManager:
    """The discovered hosts in a stable order, minus the blacklisted ones.

    Args:
        cooldown_range: (lo, hi) seconds, or None to blacklist failed hosts for good.
        clock: monotonic clock (tests pass their own).
    """

    def __init__(self, cooldown_range: tuple[float, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cooldown_range is not None:
            lo, hi = cooldown_range
            if not 1 <= lo <= hi <= 3600:
                raise ValueError(f"--blacklist-cooldown-range {lo:g} {hi:g}: need 1 <= MIN <= "
                                 "MAX <= 3600 (seconds)")
        self.cooldown_range = cooldown_range
        self._clock = clock
        self._order: list[str] = []
        self._slots: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}  # host -> end of cooldown (inf: permanent)

    def update(self, found: Mapping[str, int]) -> None:
        """Records the latest discovery result (new hosts go to the end of the order)."""
        for h in found:
            if h not in self._order:
                self._order.append(h)
        self._slots = {h: int(s) for h, s in found.items() if int(s) > 0}

    def blacklist(self, host: str) -> float | None:
        """Takes `host` out; returns the cooldown in seconds, or None when permanent."""
        n = self._failures.get(host, 0)
        self._failures[host] = n + 1
        if self.cooldown_range is None:
            self._until[host] = float("inf")
            return None
        lo, hi = self.cooldown_range
        cooldown = min(max(lo * 2 ** n + random.uniform(0, 1) * lo, lo), hi)
        self._until[host] = self._clock() + cooldown
        return cooldown

    def is_blacklisted(self, host: str) -> bool:
        return self._until.get(host, 0.0) > self._clock()

    def blacklisted_for_good(self, host: str) -> bool:
        """Blacklisted without a cooldown: the host never comes back."""
        return self._until.get(host, 0.0) == float("inf")

    def blacklisted(self) -> list[str]:
        return [h for h in self._order if self.is_blacklisted(h)]

    def available(self) -> list[HostInfo]:
        """Discovered, not blacklisted hosts with their slots, oldest first."""
        return [HostInfo(h, self._slots[h]) for h in self._order
                if h in self._slots and not self.is_blacklisted(h)]

    def total_slots(self) -> int:
        return sum(h.slots for h in self.available())
