"""The network interface each node's ranks use, chosen from how every host reaches the master.

gloo and NCCL use the address the host's own name resolves to, unless ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` name an interface: with Debian's default /etc/hosts that is 127.0.1.1 (the
other nodes then connect to their own loopback: ``Connection refused``), and on a host with a
management and a fast network it may be one that node 0 cannot reach. The agent on every host
asks the kernel which local address and interface reach the master (``protocol.Network``); this
module decides, without I/O:

- All nodes in one network namespace (one machine, a local job): loopback is right, nothing is set.
- Otherwise every node gets the interface that routes to the master; a node on the master's own
  machine that reaches it through loopback gets the one that routes to another node.
- A variable the user set (``env:``, ``--env`` or the host's own environment) is never replaced.
- Refused before anything starts: a node on another machine that reaches the master through
  loopback (the name resolves to 127.x there) or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import field

from clusterrun.agent.wire import RouteRequest, RouteTarget
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core.errors import ClusterrunError, HostError, HostsUnavailable
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import Network, Route

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_FIX_MASTER = "set `master: addr:` in the hosts file to node 0's address on a network every node reaches"


@frozen
class Interface:
    """The interface chosen for one node and why. ``name`` None: none was needed (every node on
    one machine, through loopback). ``env`` is what clusterrun sets: the ``IFNAME_VARS`` the user
    did not set; ``user_set`` the ones they did, with their values."""

    name: str | None
    address: str | None
    why: str
    env: Mapping[str, str] = field(default_factory=dict)
    user_set: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``eth0 10.0.0.12 (routes to the master 10.0.0.11; GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME set)``."""
        head = f"{self.name} {self.address}" if self.name else "loopback"
        notes = [self.why]
        if self.env:
            notes.append(", ".join(sorted(self.env)) + " set")
        notes += [f"{key}={value} yours" for key, value in sorted(self.user_set.items())]
        return f"{head} ({'; '.join(notes)})"


def better_master(master: str, networks: Sequence[Network]) -> str | None:
    """Node 0's address towards the other nodes, when some node on another machine cannot use
    ``master`` (a name that resolves to loopback there, a loopback address, no route) and node 0
    reaches another node through a real interface; else None. For a master address clusterrun
    derived itself (``127.0.0.1`` for a local node 0, node 0's host name), never one the user set."""
    if not networks:
        return None
    home = networks[0].netns
    broken = any(n.master.loopback or n.master.error for n in networks[1:] if n.netns != home)
    peer = networks[0].peer
    if broken and peer is not None and peer.source and not peer.loopback and peer.source != master:
        return peer.source
    return None


def master_derived(spec: ClusterSpec) -> bool:
    """True when clusterrun chose the master address itself (``plan.master_addr``: no
    ``master.addr``, no ``address:`` on node 0), which ``settle_master`` may then replace."""
    return spec.master_addr is None and spec.hosts[0].address is None


def settle_master(master: str, derived: bool,
                  route_all: Callable[[str], Sequence[Network]]) -> tuple[str, Sequence[Network]]:
    """The master address the job uses and how every node reaches it (``route_all(addr)``: each
    node's route, in node order): ``master``, or, when clusterrun derived it (``derived``) and
    another machine cannot use it, ``better_master``'s address, routed again. ``up``
    (``Job.prepare``) and ``clusterrun doctor`` both decide here."""
    networks = route_all(master)
    better = better_master(master, networks) if derived else None
    if better is None:
        return master, networks
    return better, route_all(better)


def reached_address(host: HostSpec, transport_address: str | None) -> str | None:
    """The address the other nodes may reach ``host`` by: its ``address:``, else the one the
    controller reached it at, else its name (none for a local host: this machine)."""
    return host.address or transport_address or (None if host.transport == "local" else host.host)


def route_request(rank: int, master: str, port: int, reached: Sequence[str | None]) -> RouteRequest:
    """The agent's ``route`` request of node ``rank``: how it reaches ``master``, and which of the
    other nodes (``reached``: each node's address, as the controller reached it) it reaches
    through another interface than loopback (always asked of node 0, the master's machine)."""
    return RouteRequest(route_to=route_target(rank, master, port, reached))


def route_target(rank: int, master: str, port: int, reached: Sequence[str | None]) -> RouteTarget:
    """What ``route`` asks of node ``rank`` (see ``route_request``); the probe may carry it too."""
    peers = [address for i, address in enumerate(reached) if i != rank and address]
    return RouteTarget(addr=master, port=port, peers=peers, always_peers=rank == 0)


def choose_interfaces(master: str, hosts: Sequence[str], networks: Sequence[Network],
                      user_env: Sequence[Mapping[str, str]]) -> list[Interface]:
    """One ``Interface`` per node (hosts in node order; ``user_env``: each node's environment as
    the plan sets it). Raises ``HostsUnavailable`` naming every host that cannot take part, the
    cause and the fix."""
    chosen, errors = decide_interfaces(master, hosts, networks, user_env)
    if errors:
        raise HostsUnavailable(list[ClusterrunError](errors))
    return chosen


def decide_interfaces(master: str, hosts: Sequence[str], networks: Sequence[Network],
                      user_env: Sequence[Mapping[str, str]]) -> tuple[list[Interface], list[HostError]]:
    """``choose_interfaces``' decision for every node, and the errors of those that cannot take
    part, instead of raising (``clusterrun doctor`` shows both)."""
    one_machine = len({n.netns for n in networks}) <= 1
    home = networks[0].netns if networks else ""
    chosen: list[Interface] = []
    errors: list[HostError] = []
    for host, net, env in zip(hosts, networks, user_env, strict=True):
        user_set = {k: v for k, v in {**net.preset, **env}.items() if k in IFNAME_VARS}
        route, error = _pick(master, host, hosts[0], net, one_machine, on_master=net.netns == home)
        if error is not None:
            if not (isinstance(error, _NoInterface) and len(user_set) == len(IFNAME_VARS)):
                errors.append(error)
            chosen.append(Interface(None, None, error.message, user_set=user_set))
            continue
        if route is None:
            chosen.append(Interface(None, None, "every node is on this machine", user_set=user_set))
            continue
        why = (f"routes to the master {master}" if route is net.master
               else f"reaches {route.target}; the master {master} is this machine")
        name = route.interface or ""
        env_set = {} if not name else {k: name for k in IFNAME_VARS if k not in user_set}
        if not name:
            why += "; its interface was not found: nothing set"
        chosen.append(Interface(route.interface, route.source, why, env=env_set, user_set=user_set))
    return chosen, errors


class _NoInterface(HostError):
    """No interface the other nodes could reach this host by: fatal unless the user chose both."""


def _pick(master: str, host: str, host0: str, net: Network, one_machine: bool,
          on_master: bool) -> tuple[Route | None, HostError | None]:
    """The route whose interface this node uses (None: loopback on one machine), or why none."""
    m = net.master
    if m.error:
        return None, HostError(host, f"cannot reach the master {master}: {m.error}", hint=_FIX_MASTER)
    if not m.loopback:
        return m, None
    if one_machine:
        return None, None
    if not on_master:
        resolved = m.resolved or "?"
        if resolved != master:
            message = (f"the master {master} resolves to {resolved} on this host, its own loopback: "
                       f"its ranks would not reach node 0 ({host0})")
            if m.hosts_line:
                hint = f"{m.hosts_line} maps {master} to {resolved}; {_FIX_MASTER}, or fix /etc/hosts on {host}"
            else:
                hint = f"{_FIX_MASTER}, or make {master} resolve to node 0's address on {host} (DNS, /etc/hosts)"
        else:
            message = f"the master {master} is a loopback address: this host's ranks would not reach node 0 ({host0})"
            hint = _FIX_MASTER
        return None, HostError(host, message, hint=hint)
    if net.peer is not None:
        return net.peer, None
    return None, _NoInterface(
        host, f"reaches the master {master} through loopback, and no other node through another interface: "
        "cannot choose the interface the other nodes reach this one by",
        hint=f"set {' and '.join(IFNAME_VARS)} for this host in `env:` to that interface")
