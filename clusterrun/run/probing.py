"""What ``Job.prepare`` asks each host before the plan: the probe, checked, and the route to the
master, on the agent that stays open to start the node; with ``Ahead``, the preflight's
requests that nothing before it changes.

All of it goes in one request per host, the probe's (round trips saved on the critical path:
docs/benchmarks.md). Once every host is found (``Transport.resolve``: ``ssh -G``), node 0's
address as the plan derives it and every node's address (the peers a route looks for) are known
before any probe, and each host then connects and is probed on its own; a separate
``route`` is asked only for a master address settled again (``interfaces.settle_master``). The
port is the kernel's route lookup's business only: a free master port is not known yet, so
``ROUTE_PORT`` stands in for it (as in ``clusterrun doctor``). The agent answers the preflight's
``inspect`` and node 0's ``listen`` as if asked alone (``Early``); that listener's port is the
master port, and node 0's start closes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import field
from typing import Any

from clusterrun.agent.wire import InspectRequest, ListenRequest, ProbeRequest
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, HostsUnavailable
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import (
    Inspection,
    Listening,
    Network,
    Probe,
    decode_inspection,
    decode_listening,
    decode_network,
    decode_probe,
)
from clusterrun.run.follower import Node
from clusterrun.run.hostchecks import MIN_PYTHON
from clusterrun.run.interfaces import reached_address, route_request, route_target
from clusterrun.run.plan import HostFacts, master_addr
from clusterrun.transports import AgentSession, Transport

ROUTE_PORT = 29500  # the route's port when the master port is not known yet (see the module docstring)


@frozen
class Ahead:
    """The preflight's requests that go in the probes' exchange (``doctor.Preflight.ahead`` decides
    which): each node's ``inspect`` by rank, and node 0's ``listen`` on the master port."""

    inspect: Mapping[int, InspectRequest] = field(default_factory=dict)
    listen: ListenRequest | None = None


@frozen
class Early:
    """What a host's probe answered of ``Ahead``: its ``inspect`` (or the agent's error), between
    ``sent`` and ``answered`` (the clock check's bracket); node 0's ``listen`` (or its error) and
    the token its listener answers."""

    sent: float
    answered: float
    inspection: Inspection | None = None
    inspect_error: str | None = None
    listening: Listening | None = None
    listen_error: str | None = None
    token: str = ""


def early_answers(host: str, answer: Mapping[str, Any], sent: float, answered: float, token: str) -> Early:
    """The ``Early`` of a probe's answer: each part decoded as if it had been asked alone."""
    found: dict[str, Any] = {}
    for key, decode in (("inspect", decode_inspection), ("listen", decode_listening)):
        part = answer.get(key)
        if isinstance(part, Mapping) and part.get("ok") is False:
            found[f"{key}_error"] = str(part.get("error") or "the agent failed")
        elif part is not None:
            found["inspection" if key == "inspect" else "listening"] = decode(host, part)
    return Early(sent, answered, token=token, **found)


def checked_probe(transport: Transport, answer: object) -> Probe:
    """The probe's answer decoded; ``AgentError`` when the host cannot run the job: its Python is
    too old, or torch is missing where no ``setup:`` could bring it (after setup the job's
    interpreter counts: the checks look at it then)."""
    probe = decode_probe(transport.name, answer)
    if probe.python_version < MIN_PYTHON:
        raise AgentError(transport.name, f"{transport.python} is Python {probe.python}; "
                         "the agent needs 3.8 or newer", hint="set `python:` for this host")
    if not probe.torch and not transport.host.setup:
        raise AgentError(transport.name, f"torch is not installed for {transport.python}",
                         hint="install torch on that host, or set `python:` to an interpreter that has it")
    return probe


def probe_all(pool: Executor, nodes: Sequence[Node], spec: ClusterSpec,
              ahead: Ahead | None = None) -> tuple[list[Probe], str | None, dict[int, Early]]:
    """Find every host (``ssh -G``: every node's address goes into each probe's route), then connect
    to each and probe it (its agent kept in its ``Node``), each host on its own, not waiting for the
    others' connections: the route to the master and what ``ahead`` asks go in the probe's request.
    The probes, the master they were routed to, and what came of ``ahead`` by rank. Raises
    ``HostsUnavailable`` naming every host that could not be found, connected or probed, the agents
    closed."""
    def find(rank: int) -> int:
        nodes[rank].transport.resolve()
        return rank

    def host_of(rank: int) -> str:
        return nodes[rank].host

    found, errors = parallel.gather(pool, find, range(len(nodes)), host_of)
    master = None
    if not errors:  # else nothing will start: the probes only say what else fails
        node0 = nodes[0].transport
        master = master_addr(spec, HostFacts(python=node0.python, address=node0.address))
    addresses = reached(spec.hosts, [n.transport for n in nodes])
    port = spec.master_port or ROUTE_PORT
    early: dict[int, Early] = {}

    def probe(rank: int) -> Probe:
        node = nodes[rank]
        node.transport.connect()
        agent = node.transport.session()
        if not node.hold(agent):  # the job was closed meanwhile (Ctrl-C)
            raise AgentError(node.host, "the job was closed while its host was probed")
        inspect = ahead.inspect.get(rank) if ahead is not None else None
        listen = ahead.listen if ahead is not None and rank == 0 else None
        free_port = rank == 0 and spec.master_port is None and listen is None  # else the listener's port
        request = ProbeRequest(state_dir=spec.state_dir, free_port=free_port,
                               route_to=None if master is None else route_target(rank, master, port, addresses),
                               inspect=inspect, listen=listen)
        sent = time.time()
        answer = agent.call(request)
        if inspect is not None or listen is not None:
            early[rank] = early_answers(node.host, answer, sent, time.time(), listen.token if listen else "")
        node.probe = checked_probe(node.transport, answer)
        return node.probe

    probes, failed = parallel.gather(pool, probe, found, host_of)
    if errors or failed:
        for node in nodes:
            node.close_agent()
        order = {node.host: rank for rank, node in reversed(list(enumerate(nodes)))}
        raise HostsUnavailable(sorted(errors + failed, key=lambda e: order.get(getattr(e, "host", ""), 0)))
    return probes, master, early


def reached(hosts: Sequence[HostSpec], transports: Sequence[Transport]) -> list[str | None]:
    """Each node's address as the other nodes may reach it (``interfaces.reached_address``)."""
    return [reached_address(h, t.address) for h, t in zip(hosts, transports, strict=True)]


def route(agent: AgentSession, host: str, rank: int, master: str, port: int,
          addresses: Sequence[str | None]) -> Network:
    """How node ``rank``'s host reaches ``master`` (the agent's ``route``)."""
    answer = agent.call(route_request(rank, master, port, addresses))
    if answer.get("ok") is False:
        raise AgentError(host, str(answer.get("error")))
    return decode_network(host, answer.get("network"), "route answer's network")


__all__ = ["ROUTE_PORT", "Ahead", "Early", "checked_probe", "early_answers", "probe_all", "reached", "route"]
