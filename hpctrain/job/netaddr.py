"""Network addresses for the rendezvous: where rank 0's store listens, whether a rank can reach it, and which
interface gloo and NCCL use. Pure socket and ioctl code, no torch; hpctrain/job/rendezvous.py (init_distributed) is
its caller and this module never imports it.

    addr, source = store_address(spans_hosts, p.master_addr, p.interface, ident.num_hosts)   # rank 0
    check_reachable(info, ident.rank, ident.host)          # other ranks, on rank 0's published info
    fed = feed_socket_ifname(p.interface, spans_hosts)    # sets NCCL_/GLOO_SOCKET_IFNAME unless already set

Where the store listens (store_address): parallel.master_addr; else the address of parallel.interface (e.g.
"ib0"); else 127.0.0.1 when every rank is on one host; else the address this host's name resolves to, unless that
is loopback (Debian images map the host name to 127.0.1.1) or nothing: then the first interface that is up and
neither loopback nor virtual. A loopback address is refused when the ranks span hosts (known under MPI; without
MPI each rank compares rank 0's host with its own), and parallel.interface feeds NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME unless they are set. FIX is the remedy every address error ends with (rendezvous.py's too).
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any

SIOCGIFFLAGS, SIOCGIFADDR, IFF_UP = 0x8913, 0x8915, 0x1
# never chosen by themselves: NCCL's default exclusions (lo, docker) and local bridges and pairs
VIRTUAL_INTERFACES = ("lo", "docker", "virbr", "veth")


def host_interfaces() -> dict[str, str]:
    """Name -> IPv4 address of each interface that is up and has one, in the kernel's order (Linux ioctls)."""
    table = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address
                continue
            if flags & IFF_UP:
                table[name] = addr
    return table


def resolve_host() -> tuple[str, str | None]:
    """This host's name and the address it resolves to (None when it does not)."""
    name = socket.getfqdn()
    try:
        return name, socket.gethostbyname(name)
    except OSError:
        return name, None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        try:
            return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
        except OSError:
            return False


def _fallback_interface(interfaces) -> tuple[str, str] | None:
    usable = [(n, a) for n, a in interfaces().items() if not n.startswith(VIRTUAL_INTERFACES) and not is_loopback(a)]
    return usable[0] if usable else None


FIX = ("set parallel.interface to the interface the ranks share (e.g. \"ib0\" or the management NIC) or "
       "parallel.master_addr to an address of rank 0's host that every host reaches")


def store_address(spans_hosts: bool, master_addr: str = "", interface: str = "", num_hosts: int = 0,
                  resolve=resolve_host, interfaces=host_interfaces) -> tuple[str, str]:
    """(address, where it came from) for rank 0's store, in the order of the module docstring. spans_hosts: the
    ranks may be on several hosts; num_hosts: how many there are, when known (then loopback is refused)."""
    if master_addr:
        addr, source = master_addr, "parallel.master_addr"
    elif interface:
        table = interfaces()
        if interface not in table:
            have = ", ".join(f"{n} {a}" for n, a in table.items())
            raise ValueError(f"parallel.interface = {interface!r}: {socket.gethostname()} has no such interface up "
                             f"with an IPv4 address (it has: {have})")
        addr, source = table[interface], f"parallel.interface = {interface!r}"
    elif not spans_hosts:
        return "127.0.0.1", "every rank on one host"
    else:
        name, resolved = resolve()
        if resolved and not is_loopback(resolved):
            return resolved, f"host name {name!r}"
        found = _fallback_interface(interfaces)
        if found is None:
            raise ValueError(f"no address of {name} that other hosts reach: its name resolves to "
                             f"{resolved or 'nothing'} and no interface besides loopback is up; {FIX}")
        return found[1], f"interface {found[0]} (host name {name!r} resolves to {resolved or 'nothing'})"
    if num_hosts > 1 and is_loopback(addr):
        raise ValueError(f"the rendezvous address {addr} ({source}) is loopback, but the job's ranks are on "
                         f"{num_hosts} hosts: the others cannot reach it; {FIX}")
    return addr, source


def check_reachable(info: dict[str, Any], rank: int, host: str) -> None:
    """A rank on another host than rank 0 refuses a loopback address at once instead of dialling itself."""
    if host != info["host"] and is_loopback(info["addr"]):
        raise ValueError(f"rank {rank} on {host}: rank 0 on {info['host']} published the rendezvous address "
                         f"{info['addr']}:{info['port']} ({info['source']}), a loopback address no other host "
                         f"reaches; {FIX}")


def feed_socket_ifname(interface: str, spans_hosts: bool, env=os.environ, resolve=resolve_host,
                       interfaces=host_interfaces) -> dict[str, str]:
    """Hands parallel.interface to NCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) unless they are set.
    Without it, on several hosts, gloo gets the fallback interface when this host's name resolves to loopback or
    nothing: gloo would bind that address, which no other host reaches (NCCL picks its own interface)."""
    wanted = {}
    if interface:
        wanted = {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}
    elif spans_hosts and (not (resolved := resolve()[1]) or is_loopback(resolved)):
        found = _fallback_interface(interfaces)
        wanted = {"GLOO_SOCKET_IFNAME": found[0]} if found else {}
    fed = {var: value for var, value in wanted.items() if var not in env}
    env.update(fed)
    return fed
