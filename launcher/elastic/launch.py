"""`hvdrun` in elastic mode: the key-value server, the spawner and the driver put together."""
from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

from .. import network
from ..env import cpu_count, worker_env
from ..hosts import SlotInfo
from ..launch import _parent_env
from ..settings import LaunchSettings
from .discovery import FixedHosts, HostDiscoveryScript
from .driver import ElasticDriver, ElasticKVServer, ElasticResult
from .spawn import ProcessSpawner

__all__ = ["ElasticSettings", "run_elastic", "unreachable_server_warning"]


@dataclass(frozen=True)
class ElasticSettings:
    """The elastic flags: `--min-np`, `--max-np`, `--host-discovery-script`, ..."""

    min_np: int
    max_np: int | None = None
    discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("min_np", "max_np", "slots_per_host", "reset_limit"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name}={v} must be >= 0")
        if self.elastic_timeout < 0:
            raise ValueError(f"elastic_timeout={self.elastic_timeout} must be >= 0")


def run_elastic(settings: LaunchSettings, elastic: ElasticSettings, *,
                on_server_started: Callable[[Any, tuple[str, int], bytes], None] | None = None,
                command: list[str] | None = None, discovery: Any = None,
                stdout: TextIO | None = None, stderr: TextIO | None = None) -> ElasticResult:
    """Runs an elastic tcp-mode job to completion.

    Args:
        settings: the launch (its hosts are the fixed host list when there is no script).
        elastic: the elastic flags.
        on_server_started: called with (server, address, secret) before any worker starts.
        command: the worker command (default: `settings.command`).
        discovery: a host discovery to use instead of the script / fixed hosts.

    Raises:
        DiscoveryError: the first run of the discovery script failed.
        OSError, ValueError: the server cannot bind, or a bad --network-interface.
    """
    err = stderr or sys.stderr
    if discovery is None:
        if elastic.discovery_script:
            discovery = HostDiscoveryScript(elastic.discovery_script, elastic.slots_per_host)
        else:
            discovery = FixedHosts(list(settings.hosts))
    first = (discovery.find_available_hosts_and_slots()
             if hasattr(discovery, "find_available_hosts_and_slots") else dict(discovery()))
    local = network.local_addresses()
    remote = [h for h in first if not network.is_local_host(h, local)]
    address = network.choose_server_address(remote, settings.network_interfaces)
    overrides = dict(settings.env_overrides)
    overrides["HOROVOD_ELASTIC_TIMEOUT"] = f"{elastic.elastic_timeout:g}"  # the driver's value
    nics = list(settings.network_interfaces)
    if not nics and remote:
        nic = network.interface_of_address(address)
        nics = [nic] if nic else []
    if nics:
        overrides.setdefault("HOROVOD_GLOO_IFACE", nics[0])
        overrides.setdefault("NCCL_SOCKET_IFNAME", ",".join(nics))
    secret = secrets.token_bytes(32)
    holder: dict[str, ElasticDriver] = {}
    server = ElasticKVServer(address, 0, secret,
                             on_ready=lambda wid, seq: holder["driver"].ready(wid, seq))
    rendezvous = server.start()
    parent = _parent_env()
    cores = cpu_count()
    spawner = ProcessSpawner(command or list(settings.command), parent,
                             ssh_port=settings.ssh_port,
                             ssh_identity_file=settings.ssh_identity_file,
                             output_dir=settings.output_filename,
                             prefix_timestamp=settings.prefix_timestamp, stdout=stdout,
                             stderr=err, width_hint=elastic.max_np or settings.num_proc)

    warned: set[str] = set()

    def env_for(slot: SlotInfo) -> dict[str, str]:
        is_remote = spawner.is_remote(slot.hostname)
        if is_remote and slot.hostname not in warned:
            text = unreachable_server_warning(slot.hostname, address, list(first),
                                              settings.network_interfaces, local)
            if text:
                warned.add(slot.hostname)
                spawner.message(text)
        return worker_env(parent, slot, remote=is_remote, overrides=overrides,
                          rendezvous=rendezvous, secret_hex=secret.hex(),
                          oversubscribed=not is_remote and slot.local_size > cores)

    try:
        if on_server_started is not None:
            on_server_started(server, rendezvous, secret)
        driver = ElasticDriver(
            discovery, spawner, env_for, server, num_proc=settings.num_proc,
            min_np=elastic.min_np, max_np=elastic.max_np,
            elastic_timeout=elastic.elastic_timeout, reset_limit=elastic.reset_limit,
            cooldown_range=elastic.cooldown_range, message=spawner.message,
            straggler_timeout=2 * _gloo_timeout(overrides) + 30.0)
        holder["driver"] = driver
        if settings.verbose:
            err.write(f"hvdrun: elastic mode: -np {settings.num_proc}, --min-np "
                      f"{elastic.min_np}, --max-np {elastic.max_np or 'unlimited'}, hosts "
                      f"{','.join(f'{h}:{n}' for h, n in first.items())}, rendezvous server "
                      f"{rendezvous[0]}:{rendezvous[1]}, command {' '.join(spawner.command)}\n")
        result = driver.run(first)
        err.write(result.summary + "\n")
        err.flush()
        return result
    finally:
        server.stop()


def unreachable_server_warning(hostname: str, address: str, first_hosts: list[str],
                               interfaces: Sequence[str], local: set[str]) -> str | None:
    """The warning for a worker host that cannot reach the rendezvous server, or None.

    The server binds once, at start: to 127.0.0.1 when every host of the first discovery is
    this machine (see `network.choose_server_address`). A host on another machine that the
    discovery adds later cannot connect to that address; a remote name that is still this
    machine (such as 127.0.0.2, reached over ssh) can, and gets no warning.

    Args:
        hostname: the host a worker is about to start on over ssh.
        address: the address the server listens on.
        first_hosts: the hosts of the first discovery.
        interfaces: `--network-interface` (the first one chose `address` when given).
        local: this machine's names and addresses (`network.local_addresses`).
    """
    if not network.is_loopback_address(address) or network.resolves_here(hostname, local):
        return None
    if interfaces:
        why = f"the address of --network-interface {interfaces[0]}"
    elif first_hosts:
        why = (f"chosen at start because every host found then ({', '.join(first_hosts)}) "
               "was this machine")
    else:
        why = "chosen at start, when the discovery had found no host"
    return (f"hvdrun: warning: host {hostname} is not this machine, but the rendezvous server "
            f"listens on {address} ({why}); workers on {hostname} cannot connect to it. "
            "Start hvdrun with --network-interface naming an interface that the other "
            "machines can reach.")


def _gloo_timeout(overrides: dict[str, str]) -> float:
    """HOROVOD_GLOO_TIMEOUT_SECONDS as the workers will see it."""
    from collective.config import read_env  # noqa: PLC0415

    raw = overrides.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    value = float(raw) if raw else read_env().gloo_timeout
    return value if value > 0 else 30.0
