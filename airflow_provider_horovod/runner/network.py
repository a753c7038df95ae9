"""Where a barrier task can be reached: one rule for both launchers.

A task offers the other hosts the address its own connection to the driver leaves from (the
kernel's route to the driver picks it), the interface holding that address (Gloo's
``HOROVOD_GLOO_IFACE``) and that interface's network in CIDR notation (Open MPI's
``btl_tcp_if_include``/``oob_tcp_if_include``). Nothing is read from the host's name: on Debian a
host's own name resolves to ``127.0.1.1`` (``/etc/hosts``), an address no peer can reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import socket

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """An address of this host, the interface that holds it and that interface's network."""

    address: str
    iface: str  # "" when no interface holds ``address``
    network: str  # CIDR, "" when no interface holds ``address``


def endpoint_of(address: str) -> Endpoint:
    """``address`` with the interface that holds it and its network (``lo``, ``127.0.0.0/8`` for loopback)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address:
                network = str(ipaddress.ip_interface("%s/%s" % (address, a.netmask)).network) if a.netmask else ""
                return Endpoint(address, name, network)
    return Endpoint(address, "", "")


def source_address(sock: socket.socket) -> str:
    """The local address a connected socket leaves from (IPv4-mapped IPv6 as plain IPv4)."""
    host = sock.getsockname()[0].split("%")[0]
    mapped = ipaddress.ip_address(host)
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return host


def task_endpoint(to_driver: str | None, executor: str) -> Endpoint:
    """Where this task is reached: ``to_driver``, the source address of its connection to the
    driver; without one (the executors cannot reach the driver, Spark coordinates), its
    executor's address as Spark reports it (the address the driver saw the executor connect from)."""
    if to_driver is not None:
        return endpoint_of(to_driver)
    host = executor.rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(OSError):
        host = socket.gethostbyname(host)
    return endpoint_of(host)
