"""`hvdrun` in elastic mode: the key-value server, the spawner and the driver put together."""
from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from .. import network
from ..env import cpu_count, worker_env
from ..hosts import SlotInfo
from ..launch import _parent_env
from ..settings import LaunchSettings
from .discovery import FixedHosts, HostDiscoveryScript
from .driver import ElasticDriver, ElasticKVServer, ElasticResult
from .spawn import ProcessSpawner

__all__ = ["ElasticSettings", "run_elastic"]


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

    def env_for(slot: SlotInfo) -> dict[str, str]:
        is_remote = spawner.is_remote(slot.hostname)
        if is_remote and address.startswith("127."):
            spawner.message(f"hvdrun: warning: host {slot.hostname} is remote but the "
                            "rendezvous server listens on 127.0.0.1 (every host was local at "
                            "start); pass --network-interface to reach remote hosts")
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
        result = driver.run()
        err.write(result.summary + "\n")
        err.flush()
        return result
    finally:
        server.stop()



def _gloo_timeout(overrides: dict[str, str]) -> float:
    """HOROVOD_GLOO_TIMEOUT_SECONDS as the workers will see it."""
    from collective.config import read_env  # noqa: PLC0415

    raw = overrides.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    value = float(raw) if raw else read_env().gloo_timeout
    return value if value > 0 else 30.0
