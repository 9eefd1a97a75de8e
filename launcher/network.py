"""Which hosts are this machine, and which local address the job's servers bind to (stdlib only).

Horovod probes NICs on every host with task services; ringvod asks the kernel instead: the
address it would use as the source to reach a remote host is an address that host can reach
us on. `--network-interface` overrides the choice.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Iterable, Sequence

__all__ = ["interface_names", "interface_address", "local_addresses", "is_local_host",
           "is_loopback_address", "resolves_here", "route_source_address",
           "interface_of_address", "choose_server_address", "split_interfaces"]

_SIOCGIFADDR = 0x8915  # linux/sockios.h


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str | None:
    """IPv4 address of a network interface, or None if it has none (Linux)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def local_addresses() -> set[str]:
    """Names and addresses under which this machine knows itself."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    for iface in interface_names():
        addr = interface_address(iface)
        if addr:
            names.add(addr)
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def is_local_host(hostname: str, local: set[str] | None = None) -> bool:
    """True if `hostname` is this machine: workers there are spawned directly, not over ssh.

    Only exact names and interface addresses count, so another loopback address such as
    127.0.0.2 is treated as a remote host (tests use this to exercise ssh on one machine).
    """
    return hostname in (local_addresses() if local is None else local)


def is_loopback_address(address: str) -> bool:
    """True for an IPv4 address in 127.0.0.0/8 or ::1; False for anything else, names included."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def resolves_here(hostname: str, local: set[str] | None = None) -> bool:
    """True if `hostname` is this machine even when it is reached over ssh.

    That is: a local name (`is_local_host`), or a name whose every address is a loopback address
    (such as 127.0.0.2) or one of this machine's addresses. A process there can connect to a
    server on 127.0.0.1. A name that does not resolve is not here.
    """
    local = local_addresses() if local is None else local
    if hostname in local:
        return True
    try:
        infos = socket.getaddrinfo(hostname, None)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(is_loopback_address(a) or a in local for a in addresses)


def route_source_address(host: str, port: int = 9) -> str:
    """The local IPv4 address the kernel would use to send to `host` (no packet is sent).

    Raises:
        OSError: the host does not resolve or is unreachable.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, port))
        return str(s.getsockname()[0])
    finally:
        s.close()


def interface_of_address(address: str) -> str | None:
    for iface in interface_names():
        if interface_address(iface) == address:
            return iface
    return None


def split_interfaces(values: Iterable[str]) -> tuple[str, ...]:
    """Interface names from `--network-interface`/`--network-interfaces` values (and
    `horovod.run(network_interface=...)`), each of which may be a comma list as horovodrun
    takes it (`--network-interface "eth0,eth1"`): split, stripped, duplicates dropped, in
    order."""
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return tuple(names)


def choose_server_address(remote_hosts: Sequence[str], interfaces: Sequence[str]) -> str:
    """Address the rendezvous server binds to and that every worker connects to.

    With `--network-interface`, the first named interface's address. Otherwise the source
    address towards the first remote host the kernel does not reach through the loopback
    interface: a remote host such as 127.0.0.2 is this machine reached over ssh, and the
    source towards it (127.0.0.1) would shut out the hosts after it. 127.0.0.1 when there is
    no such host (all-local jobs, and jobs whose remote hosts are all loopback addresses).

    Raises:
        ValueError: a named interface does not exist or has no IPv4 address.
        OSError: a remote host it looks at (the first, and each one after a loopback host)
            does not resolve.
    """
    if interfaces:
        addr = interface_address(interfaces[0])
        if addr is None:
            raise ValueError(
                f"network interface {interfaces[0]!r} has no IPv4 address on this host; "
                f"interfaces here: {', '.join(interface_names())}. Fix --network-interface.")
        return addr
    for host in remote_hosts:
        source = route_source_address(host)
        if not is_loopback_address(source):
            return source
    return "127.0.0.1"
