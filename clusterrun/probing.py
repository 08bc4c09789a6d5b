"""What ``Job.prepare`` asks each host before the plan: the probe, checked, and the route to the
master, each one request to the agent that stays open to start the node."""

from __future__ import annotations

from collections.abc import Sequence

from clusterrun.agent.wire import ProbeRequest
from clusterrun.config import HostSpec
from clusterrun.errors import AgentError
from clusterrun.hostchecks import MIN_PYTHON
from clusterrun.interfaces import reached_address, route_request
from clusterrun.protocol import Network, Probe, decode_network, decode_probe
from clusterrun.transports import AgentSession, Transport


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


def probe_request(state_dir: str | None, *, free_port: bool) -> ProbeRequest:
    return ProbeRequest(state_dir=state_dir, free_port=free_port)


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


__all__ = ["checked_probe", "probe_request", "reached", "route"]
