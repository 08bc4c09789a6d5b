"""``route``: how this host reaches the master, by the kernel's route lookup (see ``route``)."""

from __future__ import annotations

import os

from .records import boot_id
from .system import capture
from .wire import RouteRequest, RouteTarget

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


SIOCGIFADDR = 0x8915


def sockets() -> Any:
    """``_socket``, the C part of ``socket``: that module imports enum and selectors (6-7 ms at
    every route, on every host; docs/benchmarks.md)."""
    try:
        import _socket
    except ImportError:  # not CPython
        import socket as _socket  # type: ignore[no-redef]
    return _socket


def host_arg(name: str) -> bytes | str:
    """``name`` for ``getaddrinfo``: ASCII as bytes, as the idna codec would make it; a str
    makes getaddrinfo import that codec, and with it ``re`` (13 ms at every route here)."""
    return name.encode() if name.isascii() else name


def op_route(req: RouteRequest) -> dict[str, Any]:
    return {"ok": True, "network": network_route(req.route_to or RouteTarget(addr=""))}


def network_route(target: RouteTarget) -> dict[str, Any]:
    """How this host reaches the master ``target.addr`` (see ``route``): the kernel's route
    lookup, the interface of the source address it picks, this network namespace's identity, and
    the interface variables already set in this environment. When the master is reached through
    loopback (or not at all), the first of ``peers`` reached otherwise says which interface the
    other nodes can reach this host by."""
    addr, port = target.addr, target.port or 9
    master = _route(addr, port)
    peer = None
    if master["loopback"] or master["error"] or target.always_peers:
        for other in target.peers or []:
            found = _route(str(other), port)
            if not found["error"] and not found["loopback"]:
                peer = found
                break
    try:
        st = os.stat("/proc/self/ns/net")
        netns = f"{boot_id()}:{st.st_dev}:{st.st_ino}"
    except OSError:
        netns = f"{boot_id()}:{os.uname().nodename}"
    return {"netns": netns, "master": master, "peer": peer,
            "preset": {name: os.environ[name] for name in IFNAME_VARS if os.environ.get(name)}}


def _route(addr: str, port: int) -> dict[str, Any]:
    """The address ``addr`` resolves to here, the local address the kernel would send to it from
    (a connected UDP socket sends nothing) and that address's interface; or why there is none."""
    socket = sockets()

    found: dict[str, Any] = {"target": addr, "resolved": None, "source": None, "interface": None,
                             "loopback": False, "error": None}
    try:
        infos = socket.getaddrinfo(host_arg(addr), port, 0, socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        found["error"] = f"cannot resolve {addr}: {getattr(exc, 'strerror', None) or exc}"
        return found
    for family, kind, proto, _, sockaddr in infos:
        resolved = str(sockaddr[0])
        s = socket.socket(family, kind, proto)
        try:
            s.connect(sockaddr)
            source = str(s.getsockname()[0])
        except OSError as exc:
            found["error"] = found["error"] or f"no route to {addr} ({resolved}): {exc.strerror or exc}"
            continue
        finally:
            s.close()
        found.update(resolved=resolved, source=source, interface=_interface_of(source), error=None,
                     loopback=_is_loopback(resolved) or _is_loopback(source))
        break
    if found["loopback"] and found["resolved"] != addr:
        found["hosts_line"] = _hosts_line(addr, found["resolved"])
    return found


def _hosts_line(name: str, address: str) -> str | None:
    """``/etc/hosts:3: 127.0.1.1 gpu-a`` if that file maps ``name`` to ``address``."""
    try:
        with open("/etc/hosts", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if fields[:1] == [address] and name.lower() in (n.lower() for n in fields[1:]):
                    return "/etc/hosts:{}: {}".format(number, " ".join(fields))
    except OSError:
        pass
    return None


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


def _interface_of(address: str) -> str | None:
    """The interface that holds ``address``: an ioctl per interface (IPv4) or /proc/net/if_inet6,
    else ``ip -o addr`` (secondary IPv4 addresses)."""
    socket = sockets()

    address = address.split("%")[0]
    try:
        if ":" in address:
            wanted = socket.inet_pton(socket.AF_INET6, address).hex()
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and fields[0] == wanted:
                        return fields[5]
        else:
            import fcntl

            packed = socket.inet_aton(address)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                for _, name in socket.if_nameindex():
                    try:
                        ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, name.encode()[:15].ljust(40, b"\0"))
                    except OSError:
                        continue  # no IPv4 address
                    if ifreq[20:24] == packed:
                        return str(name)
            finally:
                s.close()
    except (OSError, ValueError):
        pass
    for line in (capture(["ip", "-o", "addr", "show"]) or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None
