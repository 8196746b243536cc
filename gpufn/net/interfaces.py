"""Which local interface reaches the scheduler: the address and interface name a worker
host's gang ranks (gloo, NCCL) should use, so they advertise an address peers can reach."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpufn.net.interfaces")

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Route:
    """The local end of the route to the scheduler."""

    address: str  # this host's address on that route, e.g. 10.213.0.11
    ifname: str | None  # its interface, e.g. eth0; None when it cannot be told


def scheduler_host(address: str) -> str | None:
    """The host part of a tcp:// scheduler address (None for ipc:// and the like)."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].split("?", 1)[0].rsplit(":", 1)[0].strip("[]")
    return None if host in ("", "*", "0.0.0.0", "::") else host


def local_address_towards(host: str, port: int = 9) -> str:
    """This host's source address for packets to `host` (a UDP connect sends nothing)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on this interface
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses(proc_file: Path = Path("/proc/net/if_inet6")) -> dict[str, str]:
    """IPv6 address -> interface name, from /proc/net/if_inet6."""
    out: dict[str, str] = {}
    try:
        lines = proc_file.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 6:
            raw = parts[0]
            addr = ipaddress.IPv6Address(":".join(raw[i:i + 4] for i in range(0, 32, 4)))
            out[str(addr)] = parts[5]
    return out


def interface_of(addr: str,
                 interfaces: Callable[[], list[tuple[int, str]]] = socket.if_nameindex,
                 ipv4_of: Callable[[str], str | None] = _ipv4_of,
                 ipv6: Callable[[], Mapping[str, str]] = _ipv6_addresses) -> str | None:
    """The name of the local interface that holds `addr`, or None."""
    ip = ipaddress.ip_address(addr)
    if ip.version == 6:
        return ipv6().get(str(ip))
    for _, name in interfaces():
        if ipv4_of(name) == str(ip):
            return name
    return None


def route_to(host: str) -> Route:
    """The local address and interface this host uses to reach `host`."""
    addr = local_address_towards(host)
    return Route(addr, interface_of(addr))


def socket_ifname_env(address: str, current: Mapping[str, str],
                      route: Callable[[str], Route] = route_to) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for workers that join the scheduler at
    `address`: the interface that routes there, for each variable the user left unset.

    Without them a rank advertises the address its host name resolves to, often loopback
    or the wrong NIC of a multi-homed host, and ranks on other hosts cannot connect.
    """
    missing = [v for v in SOCKET_IFNAME_VARS if not current.get(v)]
    host = scheduler_host(address)
    if not missing or host is None:
        return {}
    try:
        r = route(host)
    except OSError as e:
        log.warning("cannot tell which interface reaches the scheduler at %s (%s); "
                    "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME if gangs span hosts", host, e)
        return {}
    if r.ifname is None:
        log.warning("no interface holds %s, the address that reaches %s; set "
                    "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME if gangs span hosts", r.address, host)
        return {}
    log.info("gang traffic will use interface %s (%s), the route to %s", r.ifname, r.address, host)
    return dict.fromkeys(missing, r.ifname)
